"""The `vllm-sim` command: run (virtual time), load (HTTP), and the catalog listings."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.integration.sim.simproc import MODEL, running_sim
from vllm_sim import catalog
from vllm_sim.cli import main
from vllm_sim.workload import WorkloadSpec


def test_run_prints_a_summary_and_writes_json(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "run.json"
    args = ["--workload", "chat", "--rate", "2", "--duration", "20", "--seed", "4"]
    code = main(["run", MODEL, "--max-num-seqs", "16", *args, "--json", str(out)])
    assert code == 0
    printed = capsys.readouterr().out
    assert "ttft" in printed and "max_num_seqs=16" in printed
    summary = json.loads(out.read_text())["summary"]
    expected = WorkloadSpec.from_dict({"preset": "chat", "rate": 2, "duration": 20, "seed": 4})
    assert summary["completed"] == summary["requests"] == len(expected.generate())
    assert summary["ttft"]["p50"] > 0


def test_run_reads_a_yaml_scenario(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    scenario = tmp_path / "scenario.yaml"
    scenario.write_text(
        "name: tiny\n"
        "workload:\n"
        "  duration: 10\n"
        "  rate: {steps: [[0, 1], [5, 3]]}\n"
        "  prompt: {dist: uniform, min: 100, max: 200}\n"
        "  output: 20\n"
        "  prefix: {ratio: 0.5, groups: 2}\n"
    )
    out = tmp_path / "run.json"
    assert main(["run", MODEL, "--workload", str(scenario), "--json", str(out)]) == 0
    summary = json.loads(out.read_text())["summary"]
    assert summary["completed"] > 0
    assert summary["output_token_throughput"] * summary["duration"] == pytest.approx(
        20 * summary["completed"]
    )


def test_run_reports_a_startup_failure(capsys: pytest.CaptureFixture[str]) -> None:
    code = main(["run", MODEL, "--gpu-memory-utilization", "0.2", "--duration", "5"])
    assert code == 1
    assert "cannot start" in capsys.readouterr().err


def test_load_over_http(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "load.json"
    scale = "10"
    with running_sim(tmp_path, "--sim-time-scale", scale) as sim:
        code = main(
            [
                "load", "--url", sim.url, "--workload", "chat", "--rate", "5",
                "--duration", "5", "--time-scale", scale, "--timeout", "60",
                "--json", str(out), "--slo-ttft-ms", "1000",
            ]
        )  # fmt: skip
    assert code == 0
    result = json.loads(out.read_text())
    expected = WorkloadSpec.from_dict({"preset": "chat", "rate": 5, "duration": 5}).generate()
    assert len(result["records"]) == len(expected)
    assert result["summary"]["completed"] == len(expected)
    lengths = sorted(r["output_len"] for r in result["records"])
    assert lengths == sorted(r.max_tokens for r in expected)
    assert result["summary"]["slo_attainment"] is not None
    assert "goodput" in capsys.readouterr().out


def test_catalog_listings(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["models"]) == 0
    models = capsys.readouterr().out
    assert all(name in models for name in catalog.model_names())
    assert main(["gpus"]) == 0
    gpus = capsys.readouterr().out
    assert all(name in gpus for name in catalog.gpu_names())


def test_unknown_command(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["frobnicate"]) == 2
    assert "unknown command" in capsys.readouterr().err
