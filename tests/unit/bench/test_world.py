"""The benchmark's cluster: drains, GPUs and surge, the canary topology, and who is to blame
for a failed request. Small worlds (8B on an H100, a few requests per second) so that each
test runs in seconds; the numbers asserted follow from the rollout settings, not from a run.
"""

from __future__ import annotations

from typing import Any

import pytest
from bench.tuning import methods
from bench.tuning.scenario import Scenario, parse
from bench.tuning.world import World

from vllm_autotuner.core.topology import Topology
from vllm_autotuner.core.tuning_types import Knobs, RolloutSettings

A = Knobs(2048, 256, 0.9)
B = Knobs(1024, 128, 0.9)
LOAD_S = 60.0

BASE: dict[str, Any] = {
    "name": "world-test",
    "model": "meta-llama/Llama-3.1-8B-Instruct",
    "gpu": "H100",
    "max_model_len": 8192,
    "replicas": 2,
    "load_time_s": LOAD_S,
    "horizon_s": 900,
    "seed": 3,
    "workload": {"preset": "chat", "rate": 2.0},
    "slo": {
        "ttft": {"percentile": 95, "threshold_ms": 1000},
        "itl": {"percentile": 95, "threshold_ms": 60},
    },
}


def scenario(rollout: dict[str, Any] | None = None, **over: Any) -> Scenario:
    raw = {**BASE, **over}
    if rollout is not None:
        raw["rollout"] = rollout
    return parse(raw)


def old_and_new(w: World) -> tuple[list[Any], list[Any]]:
    """The pods on A in the order they went, and those on B in the order they were created."""
    pods = sorted(w.all_pods.values(), key=lambda p: p.slot)
    old = [p for p in pods if p.knobs.same_as(A)]
    old.sort(key=lambda p: p.terminating_since if p.terminating_since is not None else 1e18)
    return old, [p for p in pods if p.knobs.same_as(B)]


# ------------------------------------------------------------------------------------ drain


def rolled_at_300(rollout: dict[str, Any]) -> tuple[World, dict[str, int]]:
    """Long outputs (reasoning: ~1500 tokens, tens of seconds each), so that a pod always has
    requests in flight when it is told to go; a rollout to B at t = 300 s. Also the requests
    each pod had in flight then."""
    w = World(scenario(rollout, workload={"preset": "reasoning", "rate": 0.5}), A)
    w.advance_to(300)
    in_flight = {p.name: len(p.in_flight) for p in w.pods}
    w.apply(B)
    return w, in_flight


def test_drain_finishes_in_flight_requests_within_the_timeout() -> None:
    # A 120 s drain is long enough for every request in flight.
    w, _ = rolled_at_300({"shutdown_timeout_s": 120, "pre_stop_s": 5})
    w.advance_to(900)
    old, new = old_and_new(w)
    assert len(old) == 2 and len(new) == 2
    for pod in old:
        assert pod.terminating_since is not None and pod.ended_at is not None
        drain = pod.ended_at - pod.terminating_since
        # It drained for longer than the pre-stop (requests were in flight) and within it all.
        assert 5.0 < drain <= 125.0 + 1e-6, drain
        assert pod.ended_at == pytest.approx(pod.last_finish)
    assert w.failed_by_cause()["tuning"] == 0
    assert w.failed() == w.failed_by_cause()["rejected"]


def test_drain_aborts_what_is_left_at_the_deadline() -> None:
    w, in_flight = rolled_at_300({"shutdown_timeout_s": 3, "pre_stop_s": 2})
    w.advance_to(900)
    old, _ = old_and_new(w)
    for pod in old:
        assert pod.terminating_since is not None
        assert pod.ended_at == pytest.approx(pod.terminating_since + 5.0)
    tuning = w.failed_by_cause()["tuning"]
    # Requests of ~1500 tokens do not finish in 5 s: most in flight at the start were aborted.
    first = in_flight[old[0].name]
    assert first >= 3
    assert tuning >= first // 2
    assert w.failed_by_cause()["crash"] == 0


def test_timeout_zero_aborts_every_request_in_flight_at_once() -> None:
    w, in_flight = rolled_at_300({"shutdown_timeout_s": 0, "pre_stop_s": 0})
    w.advance_to(300.001)
    (gone,) = [p for p in w.all_pods.values() if p.ended_at is not None]
    assert gone.ended_at == pytest.approx(300.0)
    assert w.failed_by_cause()["tuning"] == in_flight[gone.name] > 0


# ------------------------------------------------------------------------------ GPUs, surge


def test_surge_zero_loads_the_replacement_only_once_the_old_pod_has_drained() -> None:
    s = scenario({"max_surge": 0, "shutdown_timeout_s": 120, "pre_stop_s": 5})
    w = World(s, A)
    w.advance_to(120)
    w.apply(B)
    w.advance_to(120 + 2 * LOAD_S)  # mid-rollout
    assert sum(1 for p in w.pods if p.gpu) <= 2
    w.advance_to(900)
    old, new = old_and_new(w)
    for gone, replacement in zip(old, new, strict=True):
        assert replacement.loading_since == pytest.approx(gone.ended_at)
        assert replacement.ready_since == pytest.approx(replacement.loading_since + LOAD_S)
    # maxUnavailable 1: the second old pod goes only once the first replacement is ready.
    assert old[1].terminating_since == pytest.approx(new[0].ready_since)
    assert all(p.phase == "ready" and p.knobs.same_as(B) for p in w.pods)
    assert w.replacements == 2


def test_surge_one_loads_at_once_and_keeps_every_pod_serving() -> None:
    s = scenario({"max_surge": 1})
    w = World(s, A)
    w.advance_to(120)
    w.apply(B)
    w.advance_to(900)
    old, new = old_and_new(w)
    assert new[0].loading_since == pytest.approx(120.0)  # the third GPU is free
    # maxUnavailable 0: no old pod leaves before a new one is ready.
    assert old[0].terminating_since == pytest.approx(new[0].ready_since)
    assert w.failed_by_cause()["tuning"] == 0


def test_one_replica_without_surge_fails_arrivals_during_the_restart_as_tuning() -> None:
    s = scenario({"shutdown_timeout_s": 0, "pre_stop_s": 0}, replicas=1)
    w = World(s, A)
    w.advance_to(120)
    w.apply(B)
    w.advance_to(150)
    assert not any(p.ready for p in w.pod_health())
    w.advance_to(600)
    causes = w.failed_by_cause()
    # 60 s without a ready pod at 2 req/s: about 120 arrivals found none.
    assert 80 <= causes["tuning"] <= 170
    assert causes["crash"] == 0
    assert w.failed() == causes["tuning"] + causes["rejected"]
    assert w.arrivals() == pytest.approx(2.0 * 600, rel=0.15)


def test_a_crash_without_a_rollout_is_not_blamed_on_tuning() -> None:
    # Run-time OOM above 0.85 for every budget, mean time 60 s: the pods die on their own.
    reality = {"oom_above_utilization": 0.85, "oom_min_batched_tokens": 1, "oom_mean_time_s": 60}
    s = scenario(replicas=1, reality=reality)
    w = World(s, A)
    w.advance_to(900)
    causes = w.failed_by_cause()
    assert w.crashes > 0
    assert causes["crash"] > 0
    assert causes["tuning"] == 0
    assert w.crash_left_standing()


# --------------------------------------------------------------------------------- canary


@pytest.mark.parametrize("surge", [0, 1])
def test_canary_topology_runs_both_tracks_behind_one_service(surge: int) -> None:
    s = scenario({"max_surge": surge})
    w = World(s, A)
    w.advance_to(120)
    w.apply_topology(Topology(A, 2 if surge else 1, B, surge))
    w.advance_to(600)
    stable, _ = w.ready_pods(A, "stable")
    canary, since = w.ready_pods(B, "canary")
    assert len(stable) == (2 if surge else 1)
    assert len(canary) == 1 and "canary" in canary[0]
    assert not any("canary" in name for name in stable)
    assert since is not None and since < 300
    # The Service spreads the deployment's 4 req/s over every ready pod of both tracks.
    per_pod = 4.0 / (len(stable) + 1)
    assert w.arrival_rate(stable, 300, 600) == pytest.approx(per_pod, rel=0.25)
    assert w.arrival_rate(canary, 300, 600) == pytest.approx(per_pod, rel=0.25)
    assert sum(1 for p in w.pods if p.gpu) <= 2 + surge
    assert not w.rollout_in_progress()
    # Promotion: the canary goes and the stable Deployment rolls to its knobs on every pod.
    w.apply_topology(Topology(B, 2, None, surge))
    w.advance_to(900)
    assert sorted(p.knobs.same_as(B) and p.track == "stable" for p in w.pods) == [True, True]
    assert w.failed_by_cause()["tuning"] == 0


def test_scaling_down_drains_and_counts_aborts_as_tuning() -> None:
    s = scenario({"shutdown_timeout_s": 0, "pre_stop_s": 0}, workload={"preset": "reasoning",
                                                                         "rate": 0.5})  # fmt: skip
    w = World(s, A)
    w.advance_to(300)
    doomed = max(w.pods, key=lambda p: p.slot)  # equally ready: the newer one goes
    in_flight = len(doomed.in_flight)
    w.apply_topology(Topology(A, 1, None, 0))
    w.advance_to(301)
    assert doomed.ended_at == pytest.approx(300.0)
    assert w.failed_by_cause()["tuning"] == in_flight > 0
    assert len(w.pods) == 1


def test_a_drain_of_a_queue_and_a_queue_left_at_the_horizon_read_alike() -> None:
    """Past its capacity (60 req/s per pod) a pod's queue holds requests that have already
    missed the TTFT threshold. A drain that aborts them counts them as failed by tuning and,
    apart, as late; the same queue left to the horizon is unfinished, and as late."""
    s = scenario({"shutdown_timeout_s": 0, "pre_stop_s": 0}, workload={"preset": "chat",
                                                                         "rate": 60.0})  # fmt: skip
    w = World(s, A, horizon_s=180)
    w.advance_to(120)
    doomed = max(w.pods, key=lambda p: p.slot)
    in_flight, late = len(doomed.in_flight), w.late_requests(doomed, w.t)
    assert 0 < late < in_flight  # a long queue; the running requests got their first token
    unfinished, unfinished_late = w.unfinished()
    assert unfinished == sum(len(p.in_flight) for p in w.pods) > in_flight
    assert late < unfinished_late < unfinished
    w.apply_topology(Topology(A, 1, None, 0))
    w.advance_to(121)
    assert w.failed_by_cause()["tuning"] == in_flight
    assert int(w.acc.failed_tuning_late.sum()) == late
    # At 2 req/s with a 1 s TTFT threshold nothing is late, at a drain or at the horizon.
    calm = World(scenario(), A, horizon_s=300)
    calm.advance_to(300)
    assert calm.unfinished()[1] == 0 and calm.unfinished()[0] >= 0
    assert all(calm.late_requests(p, calm.t) == 0 for p in calm.pods)


# ----------------------------------------------------------------------- exact SLO counts


def test_exact_counts_see_every_observation_prometheus_sees() -> None:
    s = scenario()
    w = World(s, A, horizon_s=300)
    w.advance_to(300)
    for metric in ("ttft", "itl"):
        hist = sum(getattr(p.engine.metrics, metric).count for p in w.pods if p.engine)
        assert w.acc.observed[metric].sum() == hist > 0
    # At 2 req/s with generous thresholds, no minute is violated either way.
    view = w.minute_view()
    assert not view.violated.any() and not view.violated_exact.any()


def test_exact_and_prometheus_views_both_flag_an_overloaded_deployment() -> None:
    s = scenario(
        workload={"preset": "chat", "rate": 60.0},
        slo={"itl": {"percentile": 95, "threshold_ms": 12}},
    )
    w = World(s, A, horizon_s=180)
    w.advance_to(180)
    view = w.minute_view()
    assert view.violated_exact.all()
    assert view.violated.all()


# ----------------------------------------------------------------------- scenario format


def test_rollout_section_defaults_and_values_reach_the_context() -> None:
    d = scenario()
    assert d.rollout == RolloutSettings(load_time_s=LOAD_S)
    s = scenario({"max_surge": 1, "canary": False, "shutdown_timeout_s": 30, "pre_stop_s": 0})
    assert s.rollout == RolloutSettings(1, False, 30.0, 0.0, LOAD_S)
    ctx = methods.context(s)
    assert ctx.rollout == s.rollout and ctx.replicas == 2


@pytest.mark.parametrize(
    ("rollout", "message"),
    [
        ({"max_surge": -1}, "rollout.max_surge"),
        ({"max_surge": 1.5}, "rollout.max_surge"),
        ({"max_surge": True}, "rollout.max_surge"),
        ({"canary": "yes"}, "rollout.canary"),
        ({"shutdown_timeout_s": -5}, "rollout.shutdown_timeout_s"),
        ({"shutdown_timeout_s": float("nan")}, "rollout.shutdown_timeout_s"),
        ({"pre_stop_s": "5s"}, "rollout.pre_stop_s"),
        ({"load_time_s": 60}, "load_time_s is a top-level key"),
        ({"maxSurge": 1}, "unknown rollout keys"),
        ([1, 2], "rollout must be a mapping"),
    ],
)
def test_bad_rollout_values_are_refused_with_a_clear_error(rollout: Any, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        scenario(rollout)


def test_bad_replicas_and_load_time_are_refused() -> None:
    with pytest.raises(ValueError, match="replicas"):
        scenario(replicas=0)
    with pytest.raises(ValueError, match="load_time_s"):
        scenario(load_time_s=-1)


def test_public_scenarios_say_what_the_cluster_allows_a_rollout() -> None:
    """Six scenarios keep one spare GPU for rollouts (surge 1); the no-surge variant of chat
    shows what the tuner does on full GPU nodes. Everything else stays at the defaults."""
    from pathlib import Path

    from bench.tuning.scenario import load

    root = Path(__file__).resolve().parents[3] / "bench" / "scenarios"
    files = sorted(root.glob("*.yaml"))
    assert len(files) == 7
    for f in files:
        s = load(f)
        surge = 0 if f.stem.endswith("no-surge") else 1
        want = RolloutSettings(max_surge=surge, load_time_s=s.load_time_s)
        assert s.rollout == want, f.name
