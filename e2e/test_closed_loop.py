"""The closed loop on one machine: the real operator process, real Prometheus, vllm-sim pods.

Four scenarios from issue 7, each on a fresh cluster (see conftest.py). Every wait is on a
condition with a deadline; assertions read the VLLMDeployment's status, its Events and the
Deployment/ReplicaSets the operator manages, as a person with kubectl would.

Run: `.venv/bin/pytest e2e -m e2e` (a few minutes per scenario on two cores).
"""

from __future__ import annotations

import time
from datetime import datetime, timedelta
from typing import Any

import pytest
from tests.support.waiting import wait_for

from e2e.conftest import MakeLoop
from e2e.harness import ClosedLoop
from vllm_autotuner.core.tuning_types import Knobs

pytestmark = [pytest.mark.slow, pytest.mark.e2e, pytest.mark.timeout(420)]

IN_FLIGHT = ("RollingOut", "Verifying")


def knobs(d: dict[str, Any]) -> Knobs:
    return Knobs.from_dict(d)


def wait_serving(loop: ClosedLoop, pods: int, timeout: float = 90.0) -> None:
    wait_for(
        lambda: loop.ready_endpoints() >= pods or not loop.operator_alive(),
        timeout,
        interval=0.5,
        message=f"{pods} ready pod(s) behind the Service",
    )
    assert loop.operator_alive(), loop.log_tail()


def trials_of(loop: ClosedLoop) -> list[dict[str, Any]]:
    return list(loop.tuning().get("trials") or [])


def tuning_of(loop: ClosedLoop) -> dict[str, Any]:
    """status.tuning; fails fast, with the log, when the operator process died on its own."""
    assert loop.operator_alive(), f"the operator exited:\n{loop.log_tail()}"
    return loop.tuning()


# --------------------------------------------------------------------------- scenario 2


def kv_bound_policy() -> dict[str, Any]:
    """Token budget and sequence cap pinned (min == max): the only lever left to the tuner
    is gpu_memory_utilization, so a KV-starved deployment can only gain by raising it."""
    return {
        "apiVersion": "vllm.autotuner.io/v1alpha1",
        "kind": "VLLMTuningPolicy",
        "metadata": {"name": "kv-bound"},
        "spec": {
            "slo": {
                "ttft": {"percentile": 95, "thresholdMs": 3000},
                "itl": {"percentile": 95, "thresholdMs": 100},
            },
            "bounds": {
                "maxNumBatchedTokens": {"min": 2048, "max": 2048, "maxStep": 2048},
                "maxNumSeqs": {"min": 256, "max": 256, "maxStep": 256},
                "gpuMemoryUtilization": {"min": 0.85, "max": 0.95, "maxStep": 0.03},
            },
            "rollout": {
                "minInterval": "30s",
                "maxPerDay": 100,
                "verifyWindow": "30s",
                "readyTimeout": "2m",
            },
            "minRequestsPerWindow": 20,
            "evaluationWindow": "30s",
        },
    }


# Llama-3.1-70B on two H100s at 0.90 leaves ~2.5 GiB of KV cache per GPU (vllm-sim's memory
# model): 'code' traffic at 1 req/s per pod preempts and queues (TTFT p95 ~10 s in
# `vllm-sim run`), while 0.92 gives ~60 % more KV and meets a 3 s TTFT target.
KV_BOUND_DEPLOYMENT: dict[str, Any] = {
    "apiVersion": "vllm.autotuner.io/v1alpha1",
    "kind": "VLLMDeployment",
    "metadata": {"name": "kv", "namespace": "default"},
    "spec": {
        "model": "meta-llama/Llama-3.1-70B-Instruct",
        "gpu": {"count": 2, "product": "H100"},
        "engine": {"tensorParallelSize": 2, "maxModelLen": 8192},
        "knobs": {"maxNumBatchedTokens": 2048, "maxNumSeqs": 256, "gpuMemoryUtilization": 0.90},
        "replicas": 2,
        "rollout": {"maxSurge": 0, "maxUnavailable": 1},
        "tuning": {"mode": "Auto", "policyRef": "kv-bound"},
    },
}
OOM_ABOVE = 0.915  # every pod: a run-time CUDA OOM soon after start above this utilization


def test_oom_candidate_is_rolled_back_marked_infeasible_and_service_keeps_serving(
    closed_loop: MakeLoop,
) -> None:
    loop = closed_loop(
        sim_env={
            "VLLM_SIM_OOM_ABOVE_UTILIZATION": str(OOM_ABOVE),
            # Virtual seconds: the pod dies before its readiness probe passes, so the
            # Deployment controller never takes the second old pod down.
            "VLLM_SIM_OOM_MEAN_TIME": "0.2",
        }
    )
    loop.apply(kv_bound_policy(), KV_BOUND_DEPLOYMENT)
    loop.start_operator()
    wait_serving(loop, pods=2)
    load = loop.start_load("code", rate=2.0)
    start_knobs = knobs(KV_BOUND_DEPLOYMENT["spec"]["knobs"])

    # The tuner must want more KV cache, and its first probe above the hazard OOMs.
    infeasible: list[dict[str, Any]] = wait_for(
        lambda: list(tuning_of(loop).get("infeasible") or []),
        timeout=240,
        interval=1.0,
        message="an infeasible configuration in status.tuning.infeasible",
    )
    entry = infeasible[0]
    bad = knobs(entry["knobs"])
    assert entry["kind"] == "OOMKilled", entry
    assert bad.gpu_memory_utilization > OOM_ABOVE
    assert bad.gpu_memory_utilization > start_knobs.gpu_memory_utilization
    # Only utilization moved: the policy pinned the other two knobs.
    assert bad.max_num_batched_tokens == start_knobs.max_num_batched_tokens
    assert bad.max_num_seqs == start_knobs.max_num_seqs

    tuning = loop.tuning()
    failed = [t for t in tuning["trials"] if knobs(t["knobs"]).same_as(bad)]
    assert failed and failed[-1]["outcome"] == "OOMKilled", tuning["trials"]
    last_good = knobs(tuning["lastGood"])
    assert last_good.gpu_memory_utilization < bad.gpu_memory_utilization
    assert tuning["lastDecision"]["action"] == "rollback" or tuning["phase"] != "RollingOut"

    # Rolled back: the Deployment runs the last good knobs again, on every replica.
    wait_for(
        lambda: loop.deployment_knobs() == _label(last_good) and loop.ready_endpoints() >= 2,
        timeout=90,
        interval=1.0,
        message=f"the Deployment back on {last_good.describe()} with 2 ready pods",
    )
    events = loop.events()
    rolled_back = [e for e in events if e.get("reason") == "TuningRolledBack"]
    assert rolled_back, [e.get("reason") for e in events]
    assert rolled_back[0]["type"] == "Warning"
    assert "OOMKilled" in rolled_back[0]["message"]
    assert "RolloutStarted" in loop.event_reasons()

    # Later candidates stay below the configuration that failed: wait for a decision made
    # after the cooldown that followed the failed rollout (the search ran again), then check
    # every trial proposed after the failure.
    cooldown_s = 30.0
    wait_for(
        lambda: _decided_after_cooldown(tuning_of(loop), cooldown_s),
        timeout=90,
        interval=1.0,
        message="a decision after the post-rollback cooldown",
    )
    for t in trials_of(loop):
        if t["id"] > failed[-1]["id"]:
            assert knobs(t["knobs"]).gpu_memory_utilization < bad.gpu_memory_utilization, t

    # The Service answered throughout: with maxUnavailable 1 and no surge, one old pod kept
    # serving while the candidate crash-looped.
    t0 = load.started_at + 10.0
    silence = load.longest_silence(t0, time.monotonic())
    assert silence < 10.0, f"no successful request for {silence:.1f} s"
    assert load.successes_since(t0) > 100


def _label(k: Knobs) -> str:
    from vllm_autotuner.core.render import knob_label

    return knob_label(k)


def _time(text: str) -> datetime:
    return datetime.fromisoformat(text.replace("Z", "+00:00"))


def _decided_after_cooldown(tuning: dict[str, Any], cooldown_s: float) -> bool:
    decided = (tuning.get("lastDecision") or {}).get("time")
    last_rollout = tuning.get("lastRolloutAt")
    if not decided or not last_rollout:
        return False
    return _time(decided) > _time(last_rollout) + timedelta(seconds=cooldown_s)
