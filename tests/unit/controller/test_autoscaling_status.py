"""The controller's side of living beside an autoscaler: the scale subresource's status fields,
status.scaling, the hold while the count moves, status.capacity and its gauge."""

from __future__ import annotations

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


async def test_capacity_is_published_in_status_and_as_the_gauge() -> None:
    rig = Rig()
    metrics = OperatorMetrics()
    rig.controller.metrics = metrics
    for _ in range(3):
        await rig.reconcile()
    capacity = rig.kube.status["capacity"]
    model = rig.kube.status["tuning"]["model"]
    assert capacity["source"] == "Model" and capacity["knobs"] == model["knobs"]
    assert abs(capacity["perReplicaRps"] - model["predictedCapacityRps"]) < 1e-3
    gauge = metrics.registry.get_sample_value(
        "vllm_autotuner_capacity_rps",
        {"namespace": "default", "deployment": "llama", "source": "predicted"},
    )
    assert gauge is not None and abs(gauge - capacity["perReplicaRps"]) < 1e-3
