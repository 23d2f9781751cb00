"""The controller's side of living beside an autoscaler: the scale subresource's status fields,
status.scaling, the hold while the count moves, status.capacity and its gauge."""

from __future__ import annotations

from typing import Any

from tests.unit.controller.test_commands_wiring import Rig, reasons
from vllm_autotuner.adapters.metrics import OperatorMetrics


async def test_the_count_moving_holds_the_rollout_and_status_says_so() -> None:
    rig = Rig()
    await rig.reconcile()
    await rig.reconcile()  # the observer's first cycle saw no pod yet
    status = rig.kube.status
    assert status["selector"] == "vllm.autotuner.io/deployment=llama"
    assert status["scaling"] == {"owner": "VLLMDeployment", "replicas": 1}
    rig.body["spec"]["replicas"] = 2  # what an HPA writes through /scale
    held = await rig.reconcile()  # metrics now: without the scale event this is a rollout
    assert "RolloutStarted" not in reasons(held)
    decision = rig.kube.status["tuning"]["lastDecision"]
    assert decision["action"] == "hold", decision
    assert "replica count moves from 1 to 2" in decision["reason"]
    scaling = rig.kube.status["scaling"]
    assert (scaling["replicas"], scaling["previousReplicas"]) == (2, 1)
    assert "changedAt" in scaling and "settledAt" not in scaling  # one pod serves, not two
    (latest,) = [m for m in rig.kube.applied if m["kind"] == "Deployment"][-1:]
    assert latest["spec"]["replicas"] == 2  # the operator renders the VLLMDeployment's count


def _gauge(metrics: OperatorMetrics) -> float | None:
    return metrics.registry.get_sample_value(
        "vllm_autotuner_capacity_rps",
        {"namespace": "default", "deployment": "llama", "source": "predicted"},
    )


async def test_capacity_is_published_in_status_and_as_the_gauge() -> None:
    """A trial publishes the lower of the two configurations' capacities; its commit changes
    the number at once to the committed knobs'; the gauge says what status says."""
    rig = Rig()
    metrics = OperatorMetrics()
    rig.controller.metrics = metrics
    seen: dict[str, dict[str, Any]] = {}
    for _ in range(8):
        events = reasons(await rig.reconcile())
        status = rig.kube.status
        for reason in ("RolloutStarted", "TuningCommitted"):
            if reason in events:
                seen[reason] = {**status["capacity"], "gauge": _gauge(metrics)}
                seen[reason]["applied"] = status["tuning"]["applied"]
                seen[reason]["model"] = status["tuning"].get("model") or {}
        if "TuningCommitted" in seen:
            break
    trial, committed = seen["RolloutStarted"], seen["TuningCommitted"]
    assert trial["source"] == "Trial" and trial["knobs"] == trial["applied"]
    # The lower of the last good knobs' (the model's, for the knobs the pods ran) and the
    # candidate's.
    assert trial["perReplicaRps"] <= trial["model"]["predictedCapacityRps"] + 1e-3
    assert committed["source"] in ("Verified", "Model")
    assert committed["knobs"] == committed["applied"] == trial["knobs"]
    assert committed["perReplicaRps"] != trial["perReplicaRps"]  # changes at the commit
    for when in (trial, committed):
        assert when["gauge"] is not None and abs(when["gauge"] - when["perReplicaRps"]) < 1e-3
