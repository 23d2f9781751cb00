"""One log line per decision: a new action or reason is logged, a repeated one is not."""

from __future__ import annotations

import json
import logging

import pytest
from kopf._core.actions.loggers import LogFormat, make_formatter

from vllm_autotuner.controller import log_decision
from vllm_autotuner.core.decide import Decision
from vllm_autotuner.core.tuning_types import Knobs, TuningState

KNOBS = Knobs(2048, 128, 0.9)
CANDIDATE = Knobs(4096, 256, 0.9)


def decision(action: str, reason: str, to_apply: Knobs | None = None) -> Decision:
    return Decision(action, reason, TuningState.initial(KNOBS), to_apply)  # type: ignore[arg-type]


def logged(caplog: pytest.LogCaptureFixture) -> list[logging.LogRecord]:
    return [r for r in caplog.records if r.name == "vllm_autotuner.controller"]


def test_a_new_decision_is_logged_with_its_knobs_and_reason(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.INFO)
    previous = {"action": "hold", "reason": "waiting", "time": "2026-01-01T00:00:00Z"}
    log_decision("ns", "a", decision("rollout", "predicted +20%", CANDIDATE), previous)
    (record,) = logged(caplog)
    assert record.getMessage() == (
        "ns/a: rollout maxNumBatchedTokens=4096 maxNumSeqs=256 gpuMemoryUtilization=0.90: "
        "predicted +20%"
    )
    payload = json.loads(make_formatter(LogFormat.JSON).format(record))
    assert payload["deployment"] == "a" and payload["action"] == "rollout"
    assert payload["knobs"] == {
        "maxNumBatchedTokens": 4096,
        "maxNumSeqs": 256,
        "gpuMemoryUtilization": 0.9,
    }


def test_the_same_decision_again_is_not_logged(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO)
    previous = {"action": "hold", "reason": "waiting", "time": "2026-01-01T00:00:00Z"}
    log_decision("ns", "a", decision("hold", "waiting"), previous)
    assert logged(caplog) == []
    log_decision("ns", "a", decision("hold", "something else"), previous)
    log_decision("ns", "a", decision("hold", "waiting"), None)
    assert len(logged(caplog)) == 2
