"""bench.canary_power: pairs of windows judged as decide() judges a canary's end."""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

import pytest
import yaml
from bench import canary_power

from tests.unit.bench.test_tuning_smoke import SMOKE
from vllm_autotuner.core.tuning_types import Knobs

# The tuning smoke test's RAG deployment, on two replicas (a canary needs them) and short
# windows.
SCENARIO: dict[str, Any] = {
    **SMOKE,
    "name": "power-rag-a100",
    "replicas": 2,
    "horizon_s": 600,
    "policy": {"evaluation_window_s": 60, "verify_window_s": 120, "min_requests_per_window": 80},
}


def _write(tmp_path: Path, **changes: Any) -> Path:
    path = tmp_path / "scenario.yaml"
    path.write_text(yaml.safe_dump({**SCENARIO, **changes}))
    return path


def test_knobs_read_as_the_tables_print_them() -> None:
    assert canary_power.parse_knobs("768/560/0.92") == Knobs(768, 560, 0.92)
    for bad in ("768/560", "a/b/c", "768/560/0.92/1"):
        with pytest.raises(argparse.ArgumentTypeError, match="TOKENS/SEQS/UTILISATION"):
            canary_power.parse_knobs(bad)


def test_the_summary_counts_verdicts_and_credited_gains() -> None:
    rows: list[dict[str, object]] = [
        {"verdict": "Promote", "credited_gain": 0.2},
        {"verdict": "Reject", "credited_gain": -0.1},
        {"verdict": "Reject", "credited_gain": None},
    ]
    s = canary_power._summary(rows, 0.0)
    assert (s["pairs"], s["promoted"], s["rejected"], s["pending"]) == (3, 1, 2, 0)
    assert (s["credited_gains"], s["credited_gain_min"], s["credited_gain_max"]) == (2, -0.1, 0.2)
    assert s["credited_gain_median"] == pytest.approx(0.05)


@pytest.mark.parametrize(
    ("changes", "args", "message"),
    [
        ({"replicas": 1}, [], "a canary needs two or more"),
        ({}, ["--candidate", "100000/16/0.9"], "outside"),
        ({}, ["--no-truth"], "--no-truth needs --rate"),
    ],
)
def test_bad_input_is_refused_before_any_work(
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    changes: dict[str, Any],
    args: list[str],
    message: str,
) -> None:
    with pytest.raises(SystemExit) as exc:
        canary_power.main([str(_write(tmp_path, **changes)), *args])
    assert exc.value.code == 2
    assert message in capsys.readouterr().err


def test_a_pair_is_judged_as_the_operator_judges_it(tmp_path: Path) -> None:
    out = tmp_path / "power.json"
    args = ["--rate", "1.0", "--no-truth", "--window", "120", "--pairs", "1"]
    args += ["--candidate", "4096/256/0.9", "--out", str(out)]
    code = canary_power.main([str(_write(tmp_path)), *args])
    assert code == 0
    result = json.loads(out.read_text())
    (pair,) = result["pairs"]
    # min_requests_per_window 80 over 2 replicas is 40, at least 30: a 120 s window at
    # 1 req/s per pod holds them, so the verdict is final and not for want of data.
    assert pair["verdict"] in ("Promote", "Reject")
    assert pair["canary_requests"] >= 40 and pair["window_s"] == 120.0
    assert "needed" not in pair["reason"]
    assert result["summary"]["pairs"] == 1 and result["summary"]["true_gain"] is None
