"""The demo's console and report: every decision printed once with its reason, latencies only
next to the knobs they were measured on, Events in time order, a timeline with a legend,
rollout/commit/rollback markers and a panel of failed requests."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from vllm_localcluster.demo import DEMO_POLICY, Sample, Timeline, Traffic, sample_of
from vllm_localcluster.demo_report import (
    _plot,
    canary_spans,
    console_measures,
    failures_per_minute,
    write_report,
)
from vllm_localcluster.narration import Narrator, console_line, in_time_order

OLD = {"maxNumBatchedTokens": 8192, "maxNumSeqs": 256, "gpuMemoryUtilization": 0.92}
NEW = {"maxNumBatchedTokens": 2048, "maxNumSeqs": 256, "gpuMemoryUtilization": 0.92}
SLO = DEMO_POLICY["spec"]["slo"]


def status(action: str, reason: str, phase: str, trials: list[dict[str, Any]]) -> dict[str, Any]:
    return {
        "tuning": {
            "phase": phase,
            "applied": NEW if trials else OLD,
            "lastDecision": {"action": action, "reason": reason},
            "trials": trials,
        }
    }


def trial(outcome: str, reason: str = "") -> dict[str, Any]:
    return {"id": 1, "knobs": NEW, "outcome": outcome, "reason": reason}


ROLLOUT_EVENT = {
    "reason": "RolloutStarted",
    "message": "rollout maxNumBatchedTokens=2048 (trial 1, from 8192): ITL p95 68 ms > 25 ms",
    "lastTimestamp": "2026-12-02T12:00:00Z",
}


def test_a_rollout_is_printed_even_when_the_poll_sees_its_verification_first() -> None:
    narrator = Narrator()
    assert narrator.news(status("hold", "not enough data", "Observing", [])) == [
        ("hold", "not enough data")
    ]
    assert narrator.news(status("hold", "not enough data", "Observing", [])) == []
    # Between two polls the tuner rolled out and started verifying: the reason is the Event's.
    verifying = status("verify", "verifying for 45 s", "Verifying", [trial("Pending")])
    news = narrator.news(verifying, [ROLLOUT_EVENT])
    assert news == [("rollout", ROLLOUT_EVENT["message"]), ("verify", "verifying for 45 s")]
    committed = status("commit", "SLO met", "Committed", [trial("Committed", "SLO met")])
    assert narrator.news(committed) == [("commit", "trial 1 (mnbt=2048,mns=256,gmu=0.92): SLO met")]
    assert narrator.news(committed) == []


def test_a_rollout_whose_event_never_comes_is_still_printed() -> None:
    narrator = Narrator(patience=2)
    verifying = status("verify", "verifying", "Verifying", [trial("Pending")])
    assert [a for a, _ in narrator.news(verifying)] == ["verify"]  # waits for the Event
    assert narrator.news(verifying) == []
    assert narrator.news(verifying) == [("rollout", "trial 1: mnbt=2048,mns=256,gmu=0.92")]
    assert narrator.news(verifying) == []


def test_a_rollout_seen_as_it_happens_carries_the_tuner_s_reason() -> None:
    narrator = Narrator()
    reason = "rollout maxNumBatchedTokens=2048 (trial 1, from 8192): ITL p95 68 ms > 25 ms"
    news = narrator.news(status("rollout", reason, "RollingOut", [trial("Pending")]))
    assert news == [("rollout", reason)]


def test_a_late_failure_after_commit_is_printed_as_a_rollback() -> None:
    narrator = Narrator()
    narrator.news(status("commit", "ok", "Committed", [trial("Committed", "ok")]))
    news = narrator.news(status("rollback", "crashed", "RolledBack", [trial("Crashed", "OOM")]))
    assert news == [("rollback", "trial 1 (mnbt=2048,mns=256,gmu=0.92): OOM")]


def observed_status(measured: dict[str, Any] | None, applied: dict[str, Any]) -> dict[str, Any]:
    observed = {"ttftP95Ms": 900.0, "itlP95Ms": 68.0, "kvCacheUsage": 0.4}
    if measured is not None:
        observed["knobs"] = measured
    return {
        "tuning": {"phase": "RollingOut", "applied": applied},
        "observed": observed,
        "conditions": [{"type": "SLOMet", "status": "False"}],
    }


def test_new_knobs_are_never_shown_with_latencies_measured_on_the_old_ones() -> None:
    line = console_line(observed_status(OLD, NEW), SLO, failed=3)
    assert "applied mnbt=2048" in line and "measured on mnbt=8192" in line
    assert "the applied knobs are not measured yet" in line and "failed requests so far: 3" in line
    same = console_line(observed_status(NEW, NEW), SLO)
    assert "not measured yet" not in same and "measured on mnbt=2048" in same
    assert "no measurement yet" in console_line({"tuning": {"applied": NEW}}, SLO)


def test_events_come_out_in_time_order_whatever_field_holds_the_time() -> None:
    events = [
        {"reason": "c", "lastTimestamp": "2026-12-02T12:00:09Z"},
        {"reason": "a", "eventTime": "2026-12-02T12:00:01.500000Z"},
        {"reason": "b", "series": {"lastObservedTime": "2026-12-02T12:00:05Z"}},
        {"reason": "z"},  # no time at all: first
    ]
    assert [e["reason"] for e in in_time_order(events)] == ["z", "a", "b", "c"]


def samples() -> list[Sample]:
    out = []
    for i in range(8):
        measured = "mnbt=8192,mns=256,gmu=0.92" if i < 5 else "mnbt=2048,mns=256,gmu=0.92"
        applied = "mnbt=8192,mns=256,gmu=0.92" if i < 3 else "mnbt=2048,mns=256,gmu=0.92"
        out.append(
            Sample(
                t=30.0 * i,
                phase="Observing",
                knobs=measured,
                ttft_ms=900.0 - 50 * i,
                itl_ms=68.0 - 6 * i,
                kv=0.4,
                rate=5.0,
                slo_met="False",
                ready="True",
                applied=applied,
                failed=0 if i < 3 else 4,
            )
        )
    return out


def test_failures_are_counted_per_minute_between_samples() -> None:
    assert failures_per_minute(samples())[:4] == [None, 0.0, 0.0, 8.0]


def test_the_timeline_has_a_legend_for_the_slo_and_the_rollouts(tmp_path: Path) -> None:
    timeline = Timeline(samples=samples())
    timeline.decisions = [(80.0, "rollout", "r"), (170.0, "commit", "c"), (200.0, "rollback", "b")]
    labels = _plot(tmp_path / "timeline.png", timeline, DEMO_POLICY)
    assert {"ITL p99", "ITL SLO", "TTFT p95", "TTFT SLO", "rollout", "commit", "rollback"} <= set(
        labels
    )
    assert labels.count("rollout") == 1
    assert (tmp_path / "timeline.png").stat().st_size > 10_000


def test_the_report_shows_the_measured_knobs_first_and_events_in_order(tmp_path: Path) -> None:
    timeline = Timeline(samples=samples(), decisions=[(80.0, "rollout", "ITL over the SLO")])
    final = {"status": {"tuning": {"applied": NEW, "trials": [trial("Committed", "ok")]},
                        "observed": {"ttftP95Ms": 500, "itlP95Ms": 20}}}  # fmt: skip
    events = [
        {"type": "Normal", "reason": "TuningCommitted", "message": "kept",
         "lastTimestamp": "2026-12-02T12:05:00Z"},
        {"type": "Normal", "reason": "RolloutStarted", "message": "trial 1",
         "lastTimestamp": "2026-12-02T12:01:00Z"},
    ]  # fmt: skip
    md, png = write_report(tmp_path, timeline, final, events, DEMO_POLICY, True, None)
    text = md.read_text()
    assert "| first observation | mnbt=8192,mns=256,gmu=0.92 | 900.0 | 68.0 |" in text
    assert text.index("RolloutStarted") < text.index("TuningCommitted")
    assert png.exists()


# --------------------------------------------------------------------------- the canary

CANARY_EVENT = {
    "metadata": {"name": "demo.1"},
    "reason": "CanaryStarted",
    "message": "canary maxNumBatchedTokens=2048 (trial 1, from 8192): ITL p99 100 ms > 25 ms",
    "lastTimestamp": "2026-12-02T12:00:00Z",
}
PROMOTED_EVENT = {
    "metadata": {"name": "demo.2"},
    "reason": "CanaryPromoted",
    "message": "canary maxNumBatchedTokens=2048 won; promoting it to every pod: fixes ITL",
    "lastTimestamp": "2026-12-02T12:01:00Z",
}


def canary_status(phase: str, outcome: str = "Pending", reason: str = "") -> dict[str, Any]:
    s = status("hold", f"{phase} ...", phase, [trial(outcome, reason)])
    s["tuning"].update(
        strategy="Canary",
        applied=OLD,
        candidate=NEW,
        analysis={
            "windowSeconds": 30.0,
            "canary": {"itlMs": 21.5},
            "baseline": {"itlMs": 96.0},
            "verdict": "Pending",
        },
    )
    return s


def test_a_canary_is_narrated_from_start_to_promotion_and_commit() -> None:
    narrator = Narrator()
    news = narrator.news(canary_status("Verifying"), [CANARY_EVENT])
    assert news[0] == ("canary", CANARY_EVENT["message"])
    promoted = status("hold", "promoting", "Promoting", [trial("Pending")])
    news = narrator.news(promoted, [CANARY_EVENT, PROMOTED_EVENT])
    assert news[0] == ("promote", PROMOTED_EVENT["message"])
    assert narrator.news(promoted, [CANARY_EVENT, PROMOTED_EVENT]) == []  # once
    committed = status("commit", "ok", "Committed", [trial("Committed", "promoted")])
    assert narrator.news(committed, [CANARY_EVENT, PROMOTED_EVENT]) == [
        ("commit", "trial 1 (mnbt=2048,mns=256,gmu=0.92): promoted")
    ]


def test_a_losing_canary_is_narrated_as_rejected() -> None:
    narrator = Narrator()
    narrator.news(canary_status("Verifying"), [CANARY_EVENT])
    lost = status("rollback", "x", "RolledBack", [trial("RolledBack", "canary lost: worse ITL")])
    assert narrator.news(lost) == [
        ("reject", "trial 1 (mnbt=2048,mns=256,gmu=0.92): canary lost: worse ITL")
    ]


def test_the_console_compares_the_canary_with_the_baseline_pods() -> None:
    line = console_line(canary_status("Verifying"), SLO)
    assert "canary mnbt=2048,mns=256,gmu=0.92 on one pod" in line
    assert "ITL p99 21.5 ms vs the baseline pods' 96.0 ms over the same 30 s (Pending)" in line
    after = console_line(status("hold", "x", "Committed", []), SLO)
    assert "canary" not in after


def test_the_timeline_keeps_the_canary_and_its_paired_window() -> None:
    during = sample_of(canary_status("Verifying"), 10.0, failed=0)
    assert during.canary == "mnbt=2048,mns=256,gmu=0.92" and during.applied.startswith("mnbt=8192")
    assert (during.canary_itl, during.baseline_itl) == (21.5, 96.0)
    after = sample_of(status("hold", "x", "Committed", []), 20.0, failed=0)
    assert after.canary is None and after.canary_itl is None


def test_canary_spans_cover_the_samples_with_a_canary() -> None:
    series = samples()
    for s in series[2:5]:
        s.canary = "mnbt=2048,mns=256,gmu=0.92"
    assert canary_spans(series) == [(60.0, 150.0, "mnbt=2048,mns=256,gmu=0.92")]
    series[-1].canary = "mnbt=1024,mns=256,gmu=0.92"  # still running at the end
    assert canary_spans(series)[-1] == (210.0, 210.0, "mnbt=1024,mns=256,gmu=0.92")


def test_the_timeline_shows_the_canary(tmp_path: Path) -> None:
    series = samples()
    for s in series[2:5]:
        s.canary, s.canary_itl, s.baseline_itl = "mnbt=2048,mns=256,gmu=0.92", 20.0, 60.0
    timeline = Timeline(samples=series)
    timeline.decisions = [(60.0, "canary", "c"), (150.0, "promote", "p"), (170.0, "commit", "c")]
    labels = _plot(tmp_path / "timeline.png", timeline, DEMO_POLICY)
    assert {"canary on one pod", "canary started", "canary promoted", "commit"} <= set(labels)
    assert {"ITL p99, canary pod", "ITL p99, baseline pods"} <= set(labels)


def test_the_report_gives_the_failed_requests_and_the_canaries(tmp_path: Path) -> None:
    timeline = Timeline(
        samples=samples(),
        decisions=[(41.0, "canary", "c"), (90.0, "promote", "p"), (100.0, "commit", "c")],
        converged_at=150.0,
    )
    final = {"status": {"tuning": {"applied": NEW, "trials": [trial("Committed", "won")]}}}
    traffic = Traffic(finished=1200, failed=2, errors={"HTTP 503: no ready endpoints": 2})
    md, _ = write_report(tmp_path, timeline, final, [CANARY_EVENT], DEMO_POLICY, True, None,
                         traffic)  # fmt: skip
    text = md.read_text()
    assert "- failed requests: **2** of 1200 (the target is 0)" in text
    assert "2 x HTTP 503: no ready endpoints" in text
    assert "first rollout decided at 00:41; converged at 02:30" in text
    assert "canaries promoted: 1, rejected: 0" in text
    assert "| 1 | mnbt=2048,mns=256,gmu=0.92 | canary, one pod | Committed | won |" in text


def test_the_console_ends_with_the_failed_requests_and_the_canaries() -> None:
    timeline = Timeline(
        samples=samples(),
        decisions=[(41.0, "canary", "c"), (90.0, "reject", "r"), (120.0, "canary", "c")],
        converged_at=None,
    )
    tuning = {"applied": NEW, "trials": [trial("RolledBack", "lost"), trial("Pending", "")]}
    traffic = Traffic(finished=900, failed=0)
    lines = console_measures(timeline, tuning, traffic, None)
    assert lines[0] == "failed requests: 0 of 900 (the target is 0)"
    assert "trials: 2 (0 committed, 1 rolled back); canaries promoted: 0, rejected: 1" in lines
    assert not any("**" in line or line.startswith("- ") for line in lines), lines
