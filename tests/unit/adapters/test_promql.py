"""The Prometheus adapter without a server: escaping, names, queries and Snapshot assembly.

Expected numbers are worked out by hand from the canned buckets in the comments next to them.
"""

from __future__ import annotations

import json
import math
import re
import shutil
import subprocess
from collections.abc import Sequence
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from vllm_autotuner.adapters.prometheus import PrometheusSource, PrometheusUnreachable
from vllm_autotuner.adapters.promql import (
    SIGNALS_BY_KEY,
    MetricNames,
    QueryFailure,
    QueryOutcome,
    Selector,
    SnapshotTarget,
    assemble,
    build_query,
    discovery_query_for_targets,
    effective_window,
    matcher,
    parse_vector,
    quote_meta,
    resolve_names,
    string_literal,
)
from vllm_autotuner.core.tuning_types import Knobs, SLOTarget

NOW = datetime(2026, 12, 1, 12, 0, 0, tzinfo=UTC)
KNOBS = Knobs(8192, 256, 0.9)

# ------------------------------------------------------------ a Go-style string literal decoder

_SIMPLE_ESCAPES = {
    "a": "\a",
    "b": "\b",
    "f": "\f",
    "n": "\n",
    "r": "\r",
    "t": "\t",
    "v": "\v",
    "\\": "\\",
    '"': '"',
    "'": "'",
}


def decode_go_string(text: str, start: int = 0) -> tuple[str, int]:
    """Decode the double-quoted literal at text[start]; return (value, index after it).

    PromQL's lexer (Go rules): a raw newline ends the string with an error, a backslash starts
    one of the escapes below, an unescaped quote ends it.
    """
    assert text[start] == '"', text[start:]
    out: list[str] = []
    i = start + 1
    while True:
        if i >= len(text):
            raise ValueError("unterminated string")
        c = text[i]
        if c == "\n":
            raise ValueError("newline in string")
        if c == '"':
            return "".join(out), i + 1
        if c != "\\":
            out.append(c)
            i += 1
            continue
        e = text[i + 1]
        if e in _SIMPLE_ESCAPES:
            out.append(_SIMPLE_ESCAPES[e])
            i += 2
        elif e in "xuU":
            n = {"x": 2, "u": 4, "U": 8}[e]
            code = int(text[i + 2 : i + 2 + n], 16)
            if e == "x" and code >= 0x80:
                raise ValueError("\\x above 0x7f is a raw byte in Go")
            if 0xD800 <= code <= 0xDFFF or code > 0x10FFFF:
                raise ValueError("invalid code point")
            out.append(chr(code))
            i += 2 + n
        elif e in "01234567":
            out.append(chr(int(text[i + 1 : i + 4], 8)))
            i += 4
        else:
            raise ValueError(f"unknown escape \\{e}")


# Label values: anything UTF-8 can carry (no lone surrogates), hostile characters favoured.
hostile = st.text(
    alphabet=st.one_of(
        st.sampled_from(list("\"\\\n\r\t{}[]()|.*+?^$,=~!`'#/ -\x00\x7f\u2028")),
        st.characters(exclude_categories=["Cs"]),
    ),
    max_size=40,
)


@given(hostile)
@settings(max_examples=300, deadline=None)
def test_string_literal_decodes_to_the_original(value: str) -> None:
    lit = string_literal(value)
    decoded, end = decode_go_string(lit + " trailing")
    assert decoded == value
    assert end == len(lit)  # the literal ends exactly where we said: no break-out
    assert "\n" not in lit


@given(st.lists(hostile, min_size=1, max_size=5), st.lists(hostile, min_size=1, max_size=5))
@settings(max_examples=200, deadline=None)
def test_selector_matches_exactly_the_given_values(nss: list[str], pods: list[str]) -> None:
    text = Selector(tuple(nss), tuple(pods)).render()
    # Parse `{namespace=~"...", pod=~"..."}` with the decoder: the structure must survive.
    assert text.startswith("{") and text.endswith("}")
    pos = 1
    parsed: dict[str, tuple[str, str]] = {}
    for label in ("namespace", "pod"):
        m = re.compile(r"(\w+)(=~|=)").match(text, pos)
        assert m is not None and m.group(1) == label, text[pos:]
        value, pos = decode_go_string(text, m.end())
        parsed[label] = (m.group(2), value)
        if label == "namespace":
            assert text[pos : pos + 2] == ", "
            pos += 2
    assert pos == len(text) - 1
    for label, values in (("namespace", nss), ("pod", pods)):
        op, value = parsed[label]
        for v in values:
            if op == "=":
                assert value == v
            else:  # Prometheus anchors the regex; Python's re agrees on escaped literals
                assert re.fullmatch(value, v, flags=re.DOTALL) is not None
        if op == "=~":
            for other in ("", "x", "a|b", ".*", values[0] + "x"):
                matches = re.fullmatch(value, other, flags=re.DOTALL) is not None
                assert matches == (other in values)


def test_escaping_by_hand() -> None:
    assert string_literal('a"b\\c\nd') == '"a\\"b\\\\c\\nd"'
    assert quote_meta("a.b*c") == "a\\.b\\*c"
    assert quote_meta("ns-1 x") == "ns-1 x"  # RE2 rejects `\-` and `\ `: leave them alone
    assert matcher("pod", ["p-1"]) == 'pod="p-1"'
    assert matcher("pod", ["b.1", "a"]) == 'pod=~"a|b\\\\.1"'


def test_label_names_are_validated_not_injected() -> None:
    with pytest.raises(ValueError, match="not a Prometheus label name"):
        discovery_query_for_targets(
            "vllm:num_requests_running", None, None, {'a="x"} or {b': "1"}, 60
        )
    with pytest.raises(ValueError):
        PrometheusSource("http://prom", pod_label="pod}")
    q = discovery_query_for_targets("vllm:num_requests_running", "ns", "p-.*", {"team": "a"}, 60)
    assert q == (
        "count by (namespace, pod, model_name) (last_over_time(vllm:num_requests_running"
        '{namespace="ns", pod=~"p-.*", team="a", pod!=""}[60s]))'
    )


@pytest.mark.skipif(shutil.which("promtool") is None, reason="promtool not installed")
def test_promtool_parses_every_query_for_hostile_names(tmp_path: Path) -> None:
    """Prometheus' own parser (promtool check rules) accepts all queries, hostile names too."""
    both = _all_colon_series()
    names = resolve_names(both + [n.replace("vllm:", "vllm_") for n in both])
    values = ['a"b', "back\\slash", "new\nline", "x|y", ".*", "}{", "ünï", "tab\tq", "\x00\x7f"]
    sel = Selector(tuple(values), tuple(reversed(values)))
    lines = ["groups:", "- name: t", "  rules:"]
    for i, signal in enumerate(SIGNALS_BY_KEY.values()):
        spelled = names.spellings(signal.key)
        assert len(spelled) == 2
        expr = build_query(signal, spelled, sel, 300)
        # A YAML double-quoted scalar escapes like JSON for what we emit.
        lines.append(f"  - record: q{i}\n    expr: {json.dumps(expr)}")
    rules = tmp_path / "rules.yml"
    rules.write_text("\n".join(lines) + "\n")
    res = subprocess.run(
        ["promtool", "check", "rules", str(rules)], capture_output=True, text=True, timeout=60
    )
    assert res.returncode == 0, res.stdout + res.stderr


# ------------------------------------------------------------------------------- name discovery


def _all_colon_series() -> list[str]:
    return [
        "vllm:request_success_total",
        "vllm:num_preemptions_total",
        "vllm:prefix_cache_hits_total",
        "vllm:prefix_cache_queries_total",
        "vllm:kv_cache_usage_perc",
        "vllm:num_requests_running",
        "vllm:num_requests_waiting",
        "vllm:cache_config_info",
        *[
            f"{h}{suffix}"
            for h in (
                "vllm:time_to_first_token_seconds",
                "vllm:inter_token_latency_seconds",
                "vllm:e2e_request_latency_seconds",
                "vllm:request_queue_time_seconds",
                "vllm:request_prefill_time_seconds",
                "vllm:request_prompt_tokens",
                "vllm:request_generation_tokens",
                "vllm:iteration_tokens_total",
            )
            for suffix in ("_bucket", "_sum", "_count")
        ],
    ]


def test_discovery_prefers_current_names() -> None:
    names = resolve_names(_all_colon_series())
    assert names.get("requests") == "vllm:request_success_total"
    assert names.get("itl") == "vllm:inter_token_latency_seconds"
    assert names.get("iteration_tokens") == "vllm:iteration_tokens_total"
    assert names.get("prefix_cache") == (
        "vllm:prefix_cache_hits_total|vllm:prefix_cache_queries_total"
    )


def test_discovery_finds_underscore_escaped_names() -> None:
    names = resolve_names([n.replace("vllm:", "vllm_") for n in _all_colon_series()])
    assert names.get("requests") == "vllm_request_success_total"
    assert names.get("ttft") == "vllm_time_to_first_token_seconds"
    assert names.get("kv_usage") == "vllm_kv_cache_usage_perc"
    assert names.get("prefix_cache") == (
        "vllm_prefix_cache_hits_total|vllm_prefix_cache_queries_total"
    )


def test_discovery_falls_back_to_old_vllm_names() -> None:
    old = [
        "vllm:request_success",  # exported without _total
        "vllm:gpu_cache_usage_perc",
        "vllm:gpu_prefix_cache_hits_total",
        "vllm:gpu_prefix_cache_queries_total",
        "vllm:time_per_output_token_seconds_bucket",
        "vllm:time_per_output_token_seconds_sum",
    ]
    names = resolve_names(old)
    assert names.get("requests") == "vllm:request_success"
    assert names.get("kv_usage") == "vllm:gpu_cache_usage_perc"
    assert names.get("itl") == "vllm:time_per_output_token_seconds"
    assert names.get("prefix_cache") == (
        "vllm:gpu_prefix_cache_hits_total|vllm:gpu_prefix_cache_queries_total"
    )
    assert names.get("ttft") is None  # not exported: no name, no query, field None


def test_mixed_fleet_reads_both_spellings_in_one_query() -> None:
    """Pods with old and new prometheus_client behind one Prometheus 2.x: one query reads both."""
    series = [*_all_colon_series(), "vllm_request_success_total"]
    names = resolve_names(series)
    assert names.spellings("requests") == (
        "vllm:request_success_total",
        "vllm_request_success_total",
    )
    assert names.spellings("ttft") == ("vllm:time_to_first_token_seconds",)
    q = build_query(
        SIGNALS_BY_KEY["requests"], names.spellings("requests"), Selector(("n",), ("p",)), 60
    )
    assert q == (
        "sum by (namespace, pod, model_name) (increase("
        '{__name__=~"vllm:request_success_total|vllm_request_success_total", '
        'namespace="n", pod="p"}[60s]))'
    )


def test_discovery_never_mixes_generations_of_a_ratio() -> None:
    names = resolve_names(["vllm:prefix_cache_hits_total", "vllm:gpu_prefix_cache_queries_total"])
    assert names.get("prefix_cache") is None


def test_histogram_needs_its_buckets() -> None:
    assert resolve_names(["vllm:time_to_first_token_seconds_sum"]).get("ttft") is None


# -------------------------------------------------------------------------------------- queries


def test_counter_query_by_hand() -> None:
    sel = Selector(("ns",), ("p2", "p1"))
    q = build_query(SIGNALS_BY_KEY["requests"], "vllm:request_success_total", sel, 300)
    assert q == (
        "sum by (namespace, pod, model_name) "
        '(increase(vllm:request_success_total{namespace="ns", pod=~"p1|p2"}[300s]))'
    )


def test_histogram_query_carries_buckets_and_sum() -> None:
    sel = Selector(("a", "b"), ("p",))
    q = build_query(SIGNALS_BY_KEY["ttft"], "vllm_time_to_first_token_seconds", sel, 60)
    sel_text = '{namespace=~"a|b", pod="p"}'
    assert q == (
        f"sum by (namespace, pod, model_name, le) "
        f"(increase(vllm_time_to_first_token_seconds_bucket{sel_text}[60s])) or "
        f"label_replace(sum by (namespace, pod, model_name) "
        f"(increase(vllm_time_to_first_token_seconds_sum{sel_text}[60s])), "
        f'"le", "sum", "le", "")'
    )


# ------------------------------------------------------------------------------------- windows


def _target(ns: str, name: str, pods: Sequence[str], **kw: Any) -> SnapshotTarget:
    base: dict[str, Any] = {
        "since": None,
        "knobs": KNOBS,
        "revision": "r1",
        "window_s": 300.0,
        "slo": (SLOTarget(95, 100.0), SLOTarget(99, 50.0), None),
        "model_name": None,
    }
    base.update(kw)
    return SnapshotTarget(namespace=ns, name=name, pods=tuple(pods), **base)


def test_window_waits_for_a_new_revision() -> None:
    t = _target("ns", "d", ["p"], since=NOW - timedelta(seconds=20))
    window, why = effective_window(t, NOW, 15, 60)
    assert window == 0 and why is not None
    assert "waiting for data from the new revision" in why and "20s ago" in why


def test_window_is_clipped_to_revision_age_and_rounded_down() -> None:
    t = _target("ns", "d", ["p"], since=NOW - timedelta(seconds=137))
    assert effective_window(t, NOW, 15, 60) == (135, None)
    old = _target("ns", "d", ["p"], since=NOW - timedelta(hours=1))
    assert effective_window(old, NOW, 15, 60) == (300, None)


# ------------------------------------------------------------------------------------ assembly


def _vec(*rows: tuple[dict[str, str], float | str]) -> list[dict[str, Any]]:
    return [{"metric": m, "value": [NOW.timestamp(), str(v)]} for m, v in rows]


def _pod(ns: str, pod: str, **extra: str) -> dict[str, str]:
    return {"namespace": ns, "pod": pod, "model_name": "m", **extra}


def _hist(ns: str, pod: str, cum: Sequence[tuple[str, float]], total: float) -> list[Any]:
    rows: list[tuple[dict[str, str], float | str]] = [(_pod(ns, pod, le=le), c) for le, c in cum]
    rows.append((_pod(ns, pod, le="sum"), total))
    return _vec(*rows)


def _shared_outcomes() -> dict[str, QueryOutcome]:
    """One batched answer for two deployments: d1 = ns1/{a1,a2}, d2 = ns2/{b1}."""
    requests = _vec(
        (_pod("ns1", "a1"), 150.0),
        (_pod("ns1", "a2"), 150.0),
        (_pod("ns2", "b1"), 60.0),
        (_pod("ns2", "a1"), 999.0),  # same pod name in the other namespace: not d1's
    )
    # TTFT (seconds). d1: a1 has 10 <= 0.1 s, 20 <= 0.5 s; a2 has 30 and 60 -> summed
    # cumulative 40 at 0.1, 80 at 0.5 and +Inf. b1: 60 all <= 0.1.
    ttft = (
        _hist("ns1", "a1", [("0.1", 10), ("0.5", 20), ("+Inf", 20)], 4.0)
        + _hist("ns1", "a2", [("0.1", 30), ("0.5", 60), ("+Inf", 60)], 12.0)
        + _hist("ns2", "b1", [("0.1", 60), ("0.5", 60), ("+Inf", 60)], 3.0)
    )
    kv = _vec(
        (_pod("ns1", "a1", autotuner_part="mean"), 0.2),
        (_pod("ns1", "a2", autotuner_part="mean"), 0.4),
        (_pod("ns1", "a1", autotuner_part="max"), 0.5),
        (_pod("ns1", "a2", autotuner_part="max"), 0.9),
        (_pod("ns2", "b1", autotuner_part="mean"), 0.1),
        (_pod("ns2", "b1", autotuner_part="max"), 0.1),
    )
    prefix = _vec(
        (_pod("ns1", "a1", autotuner_part="num"), 25.0),
        (_pod("ns1", "a1", autotuner_part="den"), 100.0),
        (_pod("ns1", "a2", autotuner_part="num"), 0.0),
        (_pod("ns1", "a2", autotuner_part="den"), 0.0),
    )
    cache = _vec(
        (
            {"namespace": "ns1", "pod": "a1", "num_gpu_blocks": "1001", "block_size": "16",
             "gpu_memory_utilization": "0.9", "kv_cache_size_tokens": "None"},
            1,
        )
    )  # fmt: skip
    return {
        "requests": parse_vector(requests),
        "ttft": parse_vector(ttft),
        "kv_usage": parse_vector(kv),
        "prefix_cache": parse_vector(prefix),
        "cache_config": parse_vector(cache),
        "preemptions": parse_vector(_vec((_pod("ns1", "a1"), 30.0))),
    }


def test_two_deployments_from_one_shared_answer() -> None:
    outcomes = _shared_outcomes()
    d1 = assemble(_target("ns1", "d1", ["a1", "a2"]), NOW, 300, outcomes)
    d2 = assemble(_target("ns2", "d2", ["b1"]), NOW, 300, outcomes)
    assert d1.available and d2.available
    assert d1.num_pods == 2 and d1.completed_requests == 300
    assert d1.request_rate == pytest.approx(1.0)  # 300 requests / 300 s
    assert d2.request_rate == pytest.approx(0.2)  # 60 / 300, not polluted by ns2/a1
    # d1 p50: rank 40 of 80 is reached exactly at the 0.1 s bound -> 100 ms.
    assert d1.ttft.p50_ms == pytest.approx(100.0)
    # p95: rank 76 lies in (0.1, 0.5] with 40 -> 80: 0.1 + 0.4 * 36/40 = 0.46 s.
    assert d1.ttft.p95_ms == pytest.approx(460.0)
    assert d1.ttft.at_slo_ms == pytest.approx(460.0)  # the SLO asks for p95
    assert d1.ttft.mean_ms == pytest.approx(200.0)  # (4 + 12) s / 80
    assert d1.ttft_attainment == pytest.approx(0.5)  # 40 of 80 under 100 ms
    # d2: all 60 in the first bucket (lower edge 0): p50 = 0.05 s.
    assert d2.ttft.p50_ms == pytest.approx(50.0)
    assert d2.ttft_attainment == pytest.approx(1.0)
    assert d1.kv_usage_mean == pytest.approx(0.3)
    assert d1.kv_usage_max == pytest.approx(0.9)
    assert d1.prefix_cache_hit_rate == pytest.approx(0.25)
    assert d2.prefix_cache_hit_rate is None  # no queries: unknown, not 0
    assert d1.preemption_rate == pytest.approx(0.1)
    assert d1.kv_cache.num_gpu_blocks == 1001 and d1.kv_cache.kv_cache_size_tokens is None
    assert d1.kv_cache.capacity_tokens() == 1000 * 16
    assert d1.knobs == KNOBS and d1.revision == "r1"
    # Signals nobody answered stay None: never an invented zero.
    assert d1.itl.p99_ms is None and d1.itl_attainment is None and d1.running_mean is None


def test_the_snapshot_carries_its_pods_age() -> None:
    """The pods' own age (not the window's clip, which a settled replica count or a canary's
    fair window also moves): what core/censoring.py needs to correct a young window."""
    outcomes = _shared_outcomes()
    unknown = assemble(_target("ns1", "d1", ["a1", "a2"]), NOW, 300, outcomes)
    assert unknown.pods_age_s is None
    young = _target(
        "ns1",
        "d1",
        ["a1", "a2"],
        since=NOW - timedelta(seconds=90),
        pods_since=NOW - timedelta(seconds=150),
    )
    snap = assemble(young, NOW, 90, outcomes)
    assert snap.pods_age_s == pytest.approx(150.0)
    assert snap.window_s == pytest.approx(90.0)


def test_rate_scale_divides_rates_not_latencies() -> None:
    outcomes = _shared_outcomes()
    t = _target("ns1", "d1", ["a1", "a2"])
    plain = assemble(t, NOW, 300, outcomes)
    scaled = assemble(t, NOW, 300, outcomes, rate_scale=5.0)
    assert scaled.request_rate == pytest.approx(plain.request_rate / 5)
    assert scaled.preemption_rate == pytest.approx(plain.preemption_rate / 5)
    assert scaled.ttft == plain.ttft
    assert scaled.completed_requests == plain.completed_requests


def test_partial_pods_are_reported_but_used() -> None:
    snap = assemble(_target("ns1", "d1", ["a1", "gone"]), NOW, 300, _shared_outcomes())
    assert snap.available and snap.num_pods == 1
    assert "gone" in snap.reason
    assert snap.request_rate == pytest.approx(0.5)


def test_no_data_for_the_pods_is_unavailable_with_names() -> None:
    snap = assemble(_target("ns3", "d3", ["x1", "x2"]), NOW, 300, _shared_outcomes())
    assert not snap.available
    assert snap.reason == "no vllm metrics for pods x1,x2 in namespace ns3 in the last 300s"


def test_nan_inf_and_negative_values_are_missing_not_numbers() -> None:
    outcomes: dict[str, QueryOutcome] = {
        "requests": parse_vector(_vec((_pod("n", "p"), 10.0))),
        "ttft": parse_vector(
            _vec(
                (_pod("n", "p", le="0.1"), "NaN"),
                (_pod("n", "p", le="+Inf"), "NaN"),
                (_pod("n", "p", le="sum"), "NaN"),
            )
        ),
        "kv_usage": parse_vector(
            _vec(
                (_pod("n", "p", autotuner_part="mean"), "+Inf"),
                (_pod("n", "p", autotuner_part="max"), -1.0),
            )
        ),
        "prefix_cache": parse_vector(
            _vec(
                (_pod("n", "p", autotuner_part="num"), -5.0),
                (_pod("n", "p", autotuner_part="den"), "NaN"),
            )
        ),
    }
    snap = assemble(_target("n", "d", ["p"]), NOW, 60, outcomes)
    assert snap.available
    assert snap.ttft.p50_ms is None and snap.ttft_attainment is None
    assert snap.kv_usage_mean is None and snap.kv_usage_max is None
    assert snap.prefix_cache_hit_rate is None


def test_negative_request_counter_is_corrupt() -> None:
    outcomes: dict[str, QueryOutcome] = {"requests": parse_vector(_vec((_pod("n", "p"), -3.0)))}
    assert not assemble(_target("n", "d", ["p"]), NOW, 60, outcomes).available


def test_failed_required_query_gives_its_reason() -> None:
    outcomes: dict[str, QueryOutcome] = {
        "requests": QueryFailure("Prometheus unreachable at http://x: refused", unreachable=True)
    }
    snap = assemble(_target("n", "d", ["p"]), NOW, 60, outcomes)
    assert not snap.available and snap.reason.startswith("Prometheus unreachable at http://x")


def test_model_filter_keeps_only_the_served_model() -> None:
    outcomes: dict[str, QueryOutcome] = {
        "requests": parse_vector(
            _vec(
                ({"namespace": "n", "pod": "p", "model_name": "m"}, 30.0),
                ({"namespace": "n", "pod": "p", "model_name": "other"}, 1000.0),
            )
        )
    }
    snap = assemble(_target("n", "d", ["p"], model_name="m"), NOW, 60, outcomes)
    assert snap.completed_requests == 30
    wrong = assemble(_target("n", "d", ["p"], model_name="llama"), NOW, 60, outcomes)
    assert not wrong.available
    assert wrong.reason == (
        "no vllm metrics for model llama on pods p in namespace n: they export model_name m, other"
    )


def test_mismatched_bucket_layouts_use_the_common_bounds() -> None:
    outcomes: dict[str, QueryOutcome] = {
        "requests": parse_vector(_vec((_pod("n", "a"), 1.0), (_pod("n", "b"), 1.0))),
        # a has an extra 0.2 bound; summing it alone would break cumulativeness.
        "ttft": parse_vector(
            _hist("n", "a", [("0.1", 5), ("0.2", 8), ("+Inf", 10)], 1.0)
            + _hist("n", "b", [("0.1", 5), ("+Inf", 10)], 1.0)
        ),
    }
    snap = assemble(_target("n", "d", ["a", "b"]), NOW, 60, outcomes)
    # Common bounds 0.1 (10) and +Inf (20): p50 = rank 10 -> reached at 0.1 s.
    assert snap.ttft.p50_ms == pytest.approx(100.0)
    # p90 = rank 18 is in the +Inf bucket -> the largest finite bound, 0.1 s.
    assert snap.ttft.p90_ms == pytest.approx(100.0)


def test_parse_vector_ignores_junk() -> None:
    junk: Any = [{"metric": {}, "value": [1, "x"]}, {"nope": 1}, "str", {"metric": {"a": "b"}}]
    assert parse_vector(junk) == []
    assert parse_vector(None) == []
    assert math.isclose(parse_vector(_vec(({}, "1e3")))[0].value, 1000.0)


# ------------------------------------------------------------------ a cycle over a fake server


class FakeTransport:
    """Answers like Prometheus for a fleet where every pod finished 60 requests."""

    def __init__(self, series: list[str], down: bool = False) -> None:
        self.series = series
        self.down = down
        self.queries: list[str] = []
        self.lookups = 0

    async def query(self, expr: str, at: float) -> Any:
        if self.down:
            raise PrometheusUnreachable("ConnectionRefusedError")
        self.queries.append(expr)
        if "request_success" not in expr:
            return []
        pods = re.search(r'pod=~?"([^"]*)"', expr)
        nss = re.search(r'namespace=~?"([^"]*)"', expr)
        assert pods and nss
        return [
            {"metric": {"namespace": ns, "pod": p}, "value": [at, "60"]}
            for ns in nss.group(1).split("|")
            for p in pods.group(1).split("|")
        ]

    async def label_values(self, label: str, match: str, start: float, end: float) -> Any:
        if self.down:
            raise PrometheusUnreachable("ConnectionRefusedError")
        self.lookups += 1
        return self.series


def _fleet(n: int, **kw: Any) -> list[SnapshotTarget]:
    return [_target(f"ns{i % 7}", f"d{i}", [f"d{i}-a", f"d{i}-b"], **kw) for i in range(n)]


async def test_queries_per_cycle_do_not_grow_with_deployments() -> None:
    src = PrometheusSource("http://prom", min_window_s=60)
    fake = FakeTransport(_all_colon_series())
    small = await src._cycle(fake, _fleet(1), NOW)
    first = src.last_cycle_queries  # includes the name lookup
    big = await src._cycle(fake, _fleet(200), NOW)
    assert src.last_cycle_queries == first - 1  # names cached: no lookup this time
    assert fake.lookups == 1
    assert all(s.available for s in [*small.values(), *big.values()])
    assert len(big) == 200 and big[("ns3", "d3")].request_rate == pytest.approx(120 / 300)
    # Two window groups (new revisions) double the per-signal queries, no more.
    mixed = _fleet(100) + _fleet(100, since=NOW - timedelta(seconds=100))
    await src._cycle(fake, mixed, NOW)
    assert src.last_cycle_queries == 2 * (first - 1)


async def test_dead_prometheus_makes_every_target_unavailable() -> None:
    src = PrometheusSource("http://prom:9090")
    out = await src._cycle(FakeTransport([], down=True), _fleet(3), NOW)
    assert len(out) == 3
    for snap in out.values():
        assert not snap.available
        assert snap.reason.startswith("Prometheus unreachable at http://prom:9090")


async def test_no_vllm_names_is_said_and_rediscovered_later() -> None:
    src = PrometheusSource("http://prom", rediscover_on_empty_s=0)
    fake = FakeTransport(["up"])
    out = await src._cycle(fake, _fleet(1), NOW)
    assert "no vllm metrics in Prometheus" in out[("ns0", "d0")].reason
    fake.series = _all_colon_series()
    out = await src._cycle(fake, _fleet(1), NOW)
    assert out[("ns0", "d0")].available and fake.lookups == 2


async def test_targets_without_pods_or_window_need_no_query() -> None:
    src = PrometheusSource("http://prom")
    fake = FakeTransport(_all_colon_series())
    out = await src._cycle(
        fake,
        [_target("n", "empty", []), _target("n", "new", ["p"], since=NOW - timedelta(seconds=5))],
        NOW,
    )
    assert out[("n", "empty")].reason == "no ready pods of the current revision"
    assert "waiting for data" in out[("n", "new")].reason
    assert src.last_cycle_queries == 0


def test_metric_names_truthiness() -> None:
    assert not MetricNames()
    assert MetricNames({"requests": ("x",)})


class _Scope:
    def __init__(self, transport: Any) -> None:
        self.transport = transport

    async def __aenter__(self) -> Any:
        return self.transport

    async def __aexit__(self, *exc: object) -> None:
        return None


async def test_snapshots_never_raises_even_on_a_bug(monkeypatch: pytest.MonkeyPatch) -> None:
    class Broken(FakeTransport):
        async def query(self, expr: str, at: float) -> Any:
            raise RuntimeError("boom")

    src = PrometheusSource("http://prom")
    monkeypatch.setattr(src, "_session", lambda: _Scope(Broken(_all_colon_series())))
    out = await src.snapshots(_fleet(2), NOW)
    assert len(out) == 2
    assert all(not s.available and "RuntimeError: boom" in s.reason for s in out.values())
