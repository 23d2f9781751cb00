"""The operator's per-deployment gauges: phase, SLO met, capacity; and the controller sets them."""

from __future__ import annotations

import copy
from typing import Any, cast

import pytest
from prometheus_client import generate_latest

from tests.support.cluster_api import CR, POLICY
from tests.support.echo_kube import EchoKube, ready_pod
from tests.support.fake_fleet import SyntheticSnapshots
from vllm_autotuner.adapters.kube import KubeClient
from vllm_autotuner.adapters.metrics import PHASES, OperatorMetrics
from vllm_autotuner.controller import Controller
from vllm_autotuner.observer import Observer


def value(metrics: OperatorMetrics, name: str, **labels: str) -> float | None:
    return metrics.registry.get_sample_value(name, labels)


def series(metrics: OperatorMetrics, name: str) -> list[str]:
    text = generate_latest(metrics.registry).decode()
    return [line for line in text.splitlines() if line.startswith(name + "{")]


def test_exactly_one_phase_is_current() -> None:
    m = OperatorMetrics()
    m.set_phase("ns", "a", "Verifying")
    m.set_phase("ns", "a", "Committed")
    current = [p for p in PHASES if value(m, "vllm_autotuner_phase", namespace="ns",
                                          deployment="a", phase=p) == 1.0]  # fmt: skip
    assert current == ["Committed"]
    assert len(series(m, "vllm_autotuner_phase")) == len(PHASES)


def test_a_phase_the_list_does_not_know_is_still_shown_and_forgotten() -> None:
    m = OperatorMetrics()
    m.set_phase("ns", "a", "Canary")
    assert value(m, "vllm_autotuner_phase", namespace="ns", deployment="a", phase="Canary") == 1
    m.forget("ns", "a")
    assert series(m, "vllm_autotuner_phase") == []


def test_slo_met_is_absent_without_data_not_zero() -> None:
    m = OperatorMetrics()
    m.set_slo_met("ns", "a", False)
    assert value(m, "vllm_autotuner_slo_met", namespace="ns", deployment="a") == 0.0
    m.set_slo_met("ns", "a", True)
    assert value(m, "vllm_autotuner_slo_met", namespace="ns", deployment="a") == 1.0
    m.set_slo_met("ns", "a", None)
    assert value(m, "vllm_autotuner_slo_met", namespace="ns", deployment="a") is None


def test_capacity_has_a_predicted_and_a_measured_series() -> None:
    m = OperatorMetrics()
    m.set_capacity("ns", "a", "predicted", 12.5)
    m.set_capacity("ns", "a", "measured", 11.0)
    got = {
        src: value(m, "vllm_autotuner_capacity_rps", namespace="ns", deployment="a", source=src)
        for src in ("predicted", "measured")
    }
    assert got == {"predicted": 12.5, "measured": 11.0}
    m.set_capacity("ns", "a", "measured", None)
    assert len(series(m, "vllm_autotuner_capacity_rps")) == 1
    with pytest.raises(ValueError, match="capacity source"):
        m.set_capacity("ns", "a", "guessed", 1.0)


def test_forget_drops_every_gauge_of_one_deployment_only() -> None:
    m = OperatorMetrics()
    for name in ("a", "b"):
        m.set_phase("ns", name, "Idle")
        m.set_slo_met("ns", name, True)
        m.set_capacity("ns", name, "predicted", 3.0)
        m.set_knobs("ns", name, {"maxNumSeqs": 256})
    m.forget("ns", "a")
    text = generate_latest(m.registry).decode()
    assert 'deployment="a"' not in text and 'deployment="b"' in text


def test_slo_thresholds_follow_the_policy() -> None:
    m = OperatorMetrics()
    m.set_slo_targets("ns", "a", [("ttft", 95.0, 800.0), ("itl", 99.0, 50.0)])
    labels = {"namespace": "ns", "deployment": "a"}
    ttft = value(
        m, "vllm_autotuner_slo_threshold_seconds", metric="ttft", percentile="95", **labels
    )
    assert ttft == 0.8
    m.set_slo_targets("ns", "a", [("itl", 95.0, 40.0)])  # the policy changed
    assert [
        line.split("{")[1].split("}")[0]
        for line in series(m, "vllm_autotuner_slo_threshold_seconds")
    ] == ['deployment="a",metric="itl",namespace="ns",percentile="95"']
    m.forget("ns", "a")
    assert series(m, "vllm_autotuner_slo_threshold_seconds") == []


async def test_the_controller_publishes_phase_and_slo_met() -> None:
    metrics = OperatorMetrics()
    kube = EchoKube()
    source = SyntheticSnapshots()
    controller = Controller(cast(KubeClient, kube), observer=Observer(source), metrics=metrics)
    body = copy.deepcopy(CR)
    body["metadata"].update(namespace="default", uid="u-1", resourceVersion="5", generation=1)
    name = body["metadata"]["name"]
    policies = {"default": copy.deepcopy(POLICY["spec"])}

    async def reconcile(children: dict[str, Any], owned: tuple[Any, ...] = ()) -> None:
        pods, sets = [p for p, _ in owned], [rs for _, rs in owned]
        await controller.reconcile(
            body,
            policies=policies,
            namespace_labels={},
            children=children,
            pods=pods,
            replicasets=sets,
        )

    await reconcile({"Deployment": None, "Service": None})
    phases = [p for p in PHASES if value(metrics, "vllm_autotuner_phase", namespace="default",
                                         deployment=name, phase=p) == 1.0]  # fmt: skip
    assert len(phases) == 1
    assert value(metrics, "vllm_autotuner_slo_met", namespace="default", deployment=name) is None

    deployment = next(m for m in kube.applied if m["kind"] == "Deployment")
    await reconcile({"Deployment": deployment, "Service": None}, (ready_pod(deployment),))
    await controller.observer.refresh()
    await reconcile({"Deployment": deployment, "Service": None}, (ready_pod(deployment),))
    met = value(metrics, "vllm_autotuner_slo_met", namespace="default", deployment=name)
    assert kube.conditions["SLOMet"] in ("True", "False")  # the window was usable
    assert met == (1.0 if kube.conditions["SLOMet"] == "True" else 0.0)


def test_labelled_gauges_expose_what_prometheus_client_gauges_expose() -> None:
    """The dict-backed families (one tuple and one float per series, for memory at 1,000
    deployments) print the same text as prometheus_client's Gauge after the same calls."""
    from prometheus_client import CollectorRegistry, Gauge

    from vllm_autotuner.adapters.metrics import LabelledGauges

    ours_registry, theirs_registry = CollectorRegistry(), CollectorRegistry()
    ours = LabelledGauges(ours_registry).family("g", "A gauge.", ["namespace", "deployment"])
    LabelledGauges(ours_registry).family("empty", "Listed without series.", ["a"])
    theirs = Gauge("g", "A gauge.", ["namespace", "deployment"], registry=theirs_registry)
    Gauge("empty", "Listed without series.", ["a"], registry=theirs_registry)
    for labels, v in [(("ns", "a"), 1.0), (("ns", "b"), 2.5), (("ns", "a"), 3.0)]:
        ours.set(*labels, value=v)
        theirs.labels(*labels).set(v)
    ours.remove("ns", "b")
    theirs.remove("ns", "b")
    ours.remove("ns", "never")  # removing an absent series is not an error
    assert generate_latest(ours_registry) == generate_latest(theirs_registry)
    with pytest.raises(ValueError, match="expected 2 label values"):
        ours.set("ns", value=1.0)
