"""The closed loop's client and pod views count what a user and kubectl would (no cluster)."""

from __future__ import annotations

import json

from e2e.harness import PodView, completion_error


def body(**choice: object) -> bytes:
    return json.dumps({"choices": [{"text": "hi", **choice}]}).encode()


def test_an_aborted_completion_is_a_failure_although_its_status_is_200() -> None:
    # What a draining vLLM (or vllm-sim) answers a request that reaches it after SIGTERM.
    assert completion_error(200, body(finish_reason="abort", text="")) == "aborted by the server"
    assert completion_error(200, body(finish_reason="length")) is None
    assert completion_error(503, b'{"error": "no ready endpoints"}').startswith("HTTP 503")
    assert completion_error(200, b"{}") == "a completion without choices"
    assert completion_error(200, b"<html>").startswith("unreadable completion")


def test_a_pod_view_reads_identity_track_knobs_and_health() -> None:
    pod = {
        "metadata": {
            "name": "demo-canary-abc",
            "uid": "u1",
            "labels": {"vllm.autotuner.io/track": "canary"},
            "annotations": {"vllm.autotuner.io/knobs": "mnbt=1024,mns=256,gmu=0.92"},
            "deletionTimestamp": "2026-12-03T12:00:00Z",
        },
        "status": {
            "startTime": "2026-12-03T11:59:00Z",
            "conditions": [{"type": "Ready", "status": "True"}],
            "containerStatuses": [{"name": "vllm", "restartCount": 2}],
        },
    }
    view = PodView.of(pod)
    assert view == PodView("demo-canary-abc", "u1", "2026-12-03T11:59:00Z",
                           "mnbt=1024,mns=256,gmu=0.92", canary=True, ready=True,
                           terminating=True, restarts=2)  # fmt: skip
    plain = PodView.of({"metadata": {"name": "demo-x", "uid": "u2"}})
    assert not plain.canary and not plain.ready and not plain.terminating and plain.restarts == 0
