"""Pause, resume and one-shot requests from annotations (core/commands.py)."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

from hypothesis import given
from hypothesis import strategies as st

from vllm_autotuner.core.commands import (
    PAUSE_ANNOTATION,
    REQUEST_ANNOTATIONS,
    forget_latest_block,
    hold_while_paused,
    read_commands,
    request_annotations,
)
from vllm_autotuner.core.decide import Decision
from vllm_autotuner.core.tuning_types import (
    Action,
    Commands,
    InfeasibleConfig,
    Knobs,
    TuningState,
)

NOW = datetime(2026, 12, 2, 12, 0, tzinfo=UTC)
K1, K2, K3 = Knobs(2048, 128, 0.9), Knobs(4096, 256, 0.9), Knobs(8192, 256, 0.92)


def test_pause_reads_true_and_nothing_else() -> None:
    for value, paused in (("true", True), ("True", True), ("yes", True), ("false", False)):
        assert read_commands({PAUSE_ANNOTATION: value}, None)[0].paused is paused
    assert read_commands(None, None) == (Commands(), {})


def test_a_one_shot_request_is_pending_until_its_value_is_handled() -> None:
    notes = {REQUEST_ANNOTATIONS["retry"]: "t1", REQUEST_ANNOTATIONS["promote"]: "t2"}
    commands, pending = read_commands(notes, {"retry": "t0"})
    assert commands == Commands(retry_requested=True, promote_requested=True)
    assert pending == {"retry": "t1", "promote": "t2"}
    commands, pending = read_commands(notes, {"retry": "t1", "promote": "t2"})
    assert commands == Commands() and pending == {}


names = st.sampled_from(sorted(REQUEST_ANNOTATIONS))
values = st.text(min_size=1, max_size=30)


@given(st.dictionaries(names, values), st.dictionaries(names, values))
def test_a_request_is_pending_exactly_when_its_value_was_not_handled(
    asked: dict[str, str], handled: dict[str, str]
) -> None:
    notes = {REQUEST_ANNOTATIONS[name]: value for name, value in asked.items()}
    commands, pending = read_commands(notes, handled)
    assert pending == {n: v for n, v in asked.items() if handled.get(n) != v}
    assert commands.retry_requested == ("retry" in pending)
    assert commands.abort_requested == ("abort" in pending)


def decision(action: Action, to_apply: Knobs | None = None) -> Decision:
    state = TuningState.initial(K1)
    return Decision(action, f"why {action}", state, to_apply)


def test_a_paused_rollout_becomes_a_hold_that_says_what_it_would_do() -> None:
    state = TuningState.initial(K1)
    held = hold_while_paused(decision("rollout", K2), state, NOW)
    assert held.action == "hold" and held.knobs_to_apply is None
    assert held.new_state.applied == K1 and held.new_state.phase == state.phase
    assert PAUSE_ANNOTATION in held.reason and "maxNumBatchedTokens=4096" in held.reason
    assert held.new_state.last_decision is not None
    assert held.new_state.last_decision.action == "hold"


@given(st.sampled_from(["hold", "recommend", "verify", "commit", "rollback"]))
def test_a_pause_keeps_every_decision_but_a_rollout(action: Action) -> None:
    original = decision(action)
    assert hold_while_paused(original, TuningState.initial(K1), NOW) is original


def blocked(knobs: Knobs, minutes: int) -> InfeasibleConfig:
    return InfeasibleConfig(knobs, "crashed", NOW + timedelta(minutes=minutes), "Crashed")


def test_retry_forgets_the_most_recent_block_only() -> None:
    state = TuningState.initial(K1)
    state = state.with_infeasible(blocked(K3, 5)).with_infeasible(blocked(K2, 1))
    after, note = forget_latest_block(state)
    assert [entry.knobs for entry in after.infeasible] == [K2]
    assert "maxNumBatchedTokens=8192" in note
    _, nothing = forget_latest_block(TuningState.initial(K1))
    assert "nothing to retry" in nothing


def test_commands_write_the_annotations_they_mean() -> None:
    assert request_annotations("pause", NOW) == {PAUSE_ANNOTATION: "true"}
    assert request_annotations("resume", NOW) == {PAUSE_ANNOTATION: None}
    stamp = request_annotations("retry", NOW)[REQUEST_ANNOTATIONS["retry"]]
    assert stamp == "2026-12-02T12:00:00.000000Z"
