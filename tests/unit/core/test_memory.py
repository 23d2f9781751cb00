"""The memory proven stable per token budget (core/memory.py): the frontier's invariants."""

from __future__ import annotations

import itertools

import pytest
from hypothesis import given
from hypothesis import strategies as st

from vllm_autotuner.api.status import TuningStatus
from vllm_autotuner.core.memory import MAX_PROOFS, TOKEN_REACH, ProvenMemory
from vllm_autotuner.core.tuning_types import Knobs, TuningState

tokens = st.integers(16, 65536)
gmus = st.sampled_from([round(0.80 + 0.01 * i, 2) for i in range(18)])
points = st.lists(st.tuples(tokens, gmus), max_size=12)
knobs = st.builds(Knobs, tokens, st.just(16), gmus)


def _dominated_by_any(pts: list[tuple[int, float]], k: Knobs) -> bool:
    return any(t >= k.max_num_batched_tokens and g >= k.gpu_memory_utilization for t, g in pts)


@given(points)
def test_the_frontier_holds_no_dominated_point_and_is_ordered(pts: list[tuple[int, float]]) -> None:
    f = ProvenMemory.of(pts).points
    assert len(f) <= MAX_PROOFS
    assert list(f) == sorted(f)
    for (t1, g1), (t2, g2) in itertools.pairwise(f):
        assert t1 < t2 and g1 > g2  # more tokens, less utilization: neither dominates
    assert set(f) <= {(t, g) for t, g in pts}


@given(points, knobs)
def test_the_frontier_covers_exactly_what_its_proofs_dominate(
    pts: list[tuple[int, float]], k: Knobs
) -> None:
    memory = ProvenMemory.of(pts)
    if len(memory.points) < MAX_PROOFS:  # nothing was dropped for room
        assert memory.covers(k) == _dominated_by_any(pts, k)
    else:
        assert not memory.covers(k) or _dominated_by_any(pts, k)


@given(points, knobs)
def test_a_proof_covers_its_knobs_and_lowers_nothing_it_reached(
    pts: list[tuple[int, float]], k: Knobs
) -> None:
    before = ProvenMemory.of(pts)
    after = before.with_proof(k)
    assert after.covers(k)
    assert after.at(k.max_num_batched_tokens) >= k.gpu_memory_utilization
    assert after.highest() >= before.highest()
    if len(after.points) < MAX_PROOFS:
        # Within a proof's reach, a new proof only adds. Beyond every reach the largest budget's
        # utilization rules, and a new largest budget may know less: that may lower it.
        for t in (16, 256, 2048, 8192, 65536, 200_000):
            if any(t <= TOKEN_REACH * pt for pt, _ in before.points):
                assert after.at(t) >= before.at(t)


@given(points)
def test_more_tokens_never_have_more_proven_memory(pts: list[tuple[int, float]]) -> None:
    memory = ProvenMemory.of(pts)
    budgets = sorted({16, 100, 256, 512, 2048, 4096, 8192, 65536, 200_000} | {t for t, _ in pts})
    values = [memory.at(t) for t in budgets]
    assert values == sorted(values, reverse=True)


@given(points, tokens)
def test_a_proof_reaches_its_budget_times_the_reach_and_no_further(
    pts: list[tuple[int, float]], t: int
) -> None:
    memory = ProvenMemory.of(pts)
    reaching = [g for pt, g in memory.points if t <= TOKEN_REACH * pt]
    if reaching:
        assert memory.at(t) == max(reaching)
    elif memory.points:
        # Beyond every reach, only what the largest budget proved (the lowest utilization).
        assert memory.at(t) == min(g for _, g in memory.points)
    else:
        assert memory.at(t) == 0.0


@given(points, knobs)
def test_an_oom_withdraws_every_proof_that_claimed_its_knobs(
    pts: list[tuple[int, float]], k: Knobs
) -> None:
    memory = ProvenMemory.of(pts)
    after = memory.without_claims_on(k)
    assert not after.covers(k)
    kept = [p for p in memory.points if not _dominated_by_any([p], k)]
    assert list(after.points) == kept


@given(points)
def test_the_frontier_survives_status(pts: list[tuple[int, float]]) -> None:
    memory = ProvenMemory.of(pts)
    assert ProvenMemory.from_list(memory.to_list()) == memory
    state = TuningState.initial(Knobs(512, 16, 0.9))
    state = TuningState(applied=state.applied, last_good=state.last_good, proven_memory=memory)
    doc = state.to_dict()
    TuningStatus.model_validate(doc)  # the CRD's status schema accepts what the tuner writes
    assert TuningState.from_dict(doc).memory() == state.memory()


def test_a_status_written_before_the_frontier_keeps_its_proof_at_the_last_good_budget() -> None:
    doc = TuningState.initial(Knobs(256, 256, 0.94)).to_dict()
    del doc["provenMemory"]
    doc["stableGpuMemoryUtilization"] = 0.96
    state = TuningState.from_dict(doc)
    assert state.stable_gmu() == pytest.approx(0.96)
    assert state.memory().at(256) == pytest.approx(0.96)
    # Its only proof is also its largest budget: beyond its reach, the same utilization.
    assert state.memory().at(2368) == pytest.approx(0.96)
    assert not state.memory().covers(Knobs(2368, 256, 0.96))
