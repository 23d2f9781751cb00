"""topology(): the Deployments a tuning state calls for, and the GPUs they take.

Invariants, over every state and rollout setting:
- the pods (GPUs) never exceed `replicas + maxSurge`;
- a canary pod exists only in a canary trial's RollingOut or Verifying phase, runs the
  candidate, and is one pod;
- the stable Deployment always runs `state.applied` (the baseline during a canary);
- without surge a canary takes one of the replicas (the GPU count stays the same); with surge
  it comes beside them (no capacity is lost);
- Promoting has no canary: the stable Deployment rolls to the candidate on every pod.
"""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from vllm_autotuner.core.topology import CANARY_PHASES, Topology, canary_running, topology
from vllm_autotuner.core.tuning_types import (
    DeploymentContext,
    Knobs,
    Phase,
    RolloutSettings,
    Strategy,
    TuningState,
)

BASE = Knobs(8192, 1024, 0.92)
CAND = Knobs(2048, 256, 0.92)
PHASES: list[Phase] = [
    "Idle",
    "Observing",
    "Candidate",
    "RollingOut",
    "Verifying",
    "Promoting",
    "Committed",
    "RolledBack",
    "Holding",
]
STRATEGIES: list[Strategy] = ["Rolling", "Canary"]


def ctx(replicas: int, surge: int = 0, canary: bool = True) -> DeploymentContext:
    return DeploymentContext(
        model="meta-llama/Llama-3.1-8B-Instruct",
        gpu_product="H100",
        replicas=replicas,
        rollout=RolloutSettings(max_surge=surge, canary=canary),
    )


def state(phase: Phase, strategy: Strategy, candidate: Knobs | None = CAND) -> TuningState:
    applied = CAND if phase == "Promoting" else BASE
    return TuningState(
        applied=applied, last_good=BASE, phase=phase, candidate=candidate, strategy=strategy
    )


def test_a_canary_takes_one_replica_without_surge() -> None:
    t = topology(state("Verifying", "Canary"), ctx(3))
    assert t == Topology(BASE, 2, CAND, 0)
    assert (t.canary_replicas, t.pods) == (1, 3)


def test_a_canary_comes_beside_the_replicas_with_surge() -> None:
    t = topology(state("RollingOut", "Canary"), ctx(3, surge=1))
    assert t == Topology(BASE, 3, CAND, 1)
    assert t.pods == 4


def test_promoting_rolls_the_stable_deployment_and_has_no_canary() -> None:
    t = topology(state("Promoting", "Canary"), ctx(3))
    assert t == Topology(CAND, 3, None, 0)


def test_a_rolling_trial_has_no_canary() -> None:
    rolling = TuningState(CAND, BASE, phase="RollingOut", candidate=CAND, strategy="Rolling")
    assert topology(rolling, ctx(3)) == Topology(CAND, 3, None, 0)


def test_scaled_to_zero_during_a_canary_takes_no_gpu() -> None:
    """A VLLMDeployment may be scaled to 0 replicas (spec.replicas >= 0) while its canary
    runs: the user asked for no GPU, so no canary pod either."""
    t = topology(state("Verifying", "Canary"), ctx(0))
    assert t.pods == 0


@given(
    phase=st.sampled_from(PHASES),
    strategy=st.sampled_from(STRATEGIES),
    has_candidate=st.booleans(),
    replicas=st.integers(0, 64),
    surge=st.integers(-1, 4),
    canary=st.booleans(),
)
def test_topology_invariants(
    phase: Phase,
    strategy: Strategy,
    has_candidate: bool,
    replicas: int,
    surge: int,
    canary: bool,
) -> None:
    s = state(phase, strategy, CAND if has_candidate else None)
    c = ctx(replicas, surge, canary)
    t = topology(s, c)
    allowed_surge = max(0, surge)
    # GPUs: never more than the replicas plus what a rolling update may add.
    assert t.pods <= replicas + allowed_surge
    assert t.stable_replicas >= 0
    # The stable Deployment runs what status says is applied.
    assert t.stable == s.applied
    in_canary = strategy == "Canary" and has_candidate and phase in CANARY_PHASES
    assert canary_running(s) == in_canary
    if t.canary is not None:
        assert in_canary
        assert t.canary == s.candidate and t.canary_replicas == 1
        # The baseline keeps every pod it can: all with surge, all but the canary's without.
        assert t.stable_replicas == (replicas if allowed_surge else replicas - 1)
    else:
        assert t.canary_replicas == 0
        assert t.stable_replicas == replicas
    if phase == "Promoting":
        assert t.canary is None
    if in_canary and replicas >= 1:
        assert t.canary is not None
