"""PromQL for the tuner's Snapshot: names, escaping, batched queries and assembly, without I/O.

Why a separate, pure module: everything here is decided from strings and dictionaries, so the
hard parts (escaping hostile label values, choosing among vLLM's renamed metrics, turning one
batched answer into many Snapshots) are tested without a server, and the async operator path and
the sync `recommend` path share exactly the same code.

Scaling: a cycle asks one query per signal for ALL deployments that share a window, selecting
their pods by `namespace=~"a|b", pod=~"p1|p2|..."` and grouping `by (namespace, pod, ...)`;
`assemble` then sums each deployment's own pods. The regex cross product may admit a pod of one
namespace under another deployment's name; assembly filters on the exact (namespace, pod) pairs.

Percentiles are computed here from bucket increases (`core.snapshot.histogram_quantile`), so a
histogram costs one query whatever the number of percentiles and SLO targets; its `_sum` rides in
the same query under `le="sum"`, and its count is the `+Inf` bucket.
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any, Literal

from vllm_autotuner.core.snapshot import (
    KVCacheInfo,
    LatencySummary,
    LengthSummary,
    Snapshot,
    fraction_below,
    histogram_quantile,
)
from vllm_autotuner.core.tuning_types import Knobs, SLOTarget

MODEL_LABEL = "model_name"
PART_LABEL = "autotuner_part"  # added by label_replace to tell two halves of one query apart
SUM_LE = "sum"  # the `le` value under which a histogram's _sum travels with its buckets
DISCOVERY_MATCH = '{__name__=~"vllm[:_].*"}'
PERCENTILES = (0.5, 0.9, 0.95, 0.99)
# Finished requests per second one vLLM pod cannot exceed (a generous bound: the fastest
# engines finish thousands per second), beyond which a counter is corrupt.
MAX_PLAUSIBLE_RATE_PER_POD = 1e5
# The most requests one pod can hold running or queued (vLLM caps max_num_seqs at 65536 per
# engine; a queue of millions is a corrupt or hostile series), and the longest latency bucket
# that means anything (a day). Values beyond are dropped as corrupt, never published.
MAX_PLAUSIBLE_REQUESTS_PER_POD = 1e6
MAX_PLAUSIBLE_LATENCY_S = 86_400.0
MAX_PLAUSIBLE_TOKENS = 1e8  # per request or per step: beyond any context length
MAX_MODEL_NAMES_SHOWN = 5
MAX_MODEL_NAME_SHOWN = 64

SignalKind = Literal[
    "histogram", "counter", "gauge_mean", "gauge_sum", "info", "ratio", "dispersion"
]
# Burstiness: each pod's first tokens per scrape interval (`idelta` of the TTFT histogram's
# count: exact counts, no extrapolation; any scrape interval up to half the range), sampled
# DISPERSION_STEPS times over the window by a subquery. Sampling an interval twice or not at
# all leaves the variance over the mean unbiased, so the step need not match the scrape.
IDELTA_RANGE_S = 120
DISPERSION_STEPS = 40
DISPERSION_SEGMENTS = 4
# Segment means that spread about their straight line more than this many times what Poisson
# counts give them (for Poisson counts, a chi-square with 2 degrees of freedom over 2 passes 4
# with probability e^-4, 1.8 %): the load changed inside the window, and not as a ramp.
DISPERSION_STEADY = 4.0


@dataclass(frozen=True)
class Signal:
    """One logical metric and the names vLLM has exported it under, newest first
    (vLLM docs/usage/metrics.md).

    For `ratio` signals each candidate is "numerator|denominator" so that a pair is always taken
    from the same generation of names (never new hits over old queries).
    """

    key: str
    kind: SignalKind
    candidates: tuple[str, ...]


# Counters are listed with and without `_total`: prometheus_client appends it, but
# relabelling or other exporters may not. `iteration_tokens_total` is a histogram whose base
# name already ends in `_total` (vLLM loggers.py).
SIGNALS: tuple[Signal, ...] = (
    Signal("requests", "counter", ("vllm:request_success_total", "vllm:request_success")),
    Signal("preemptions", "counter", ("vllm:num_preemptions_total", "vllm:num_preemptions")),
    Signal("ttft", "histogram", ("vllm:time_to_first_token_seconds",)),
    Signal(
        "itl",
        "histogram",
        ("vllm:inter_token_latency_seconds", "vllm:time_per_output_token_seconds"),
    ),
    Signal("e2e", "histogram", ("vllm:e2e_request_latency_seconds",)),
    Signal("queue_time", "histogram", ("vllm:request_queue_time_seconds",)),
    Signal("prefill_time", "histogram", ("vllm:request_prefill_time_seconds",)),
    Signal("prompt_len", "histogram", ("vllm:request_prompt_tokens",)),
    Signal("generation_len", "histogram", ("vllm:request_generation_tokens",)),
    Signal("iteration_tokens", "histogram", ("vllm:iteration_tokens_total",)),
    Signal("kv_usage", "gauge_mean", ("vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc")),
    Signal("running", "gauge_sum", ("vllm:num_requests_running",)),
    Signal("waiting", "gauge_sum", ("vllm:num_requests_waiting",)),
    Signal(
        "prefix_cache",
        "ratio",
        (
            "vllm:prefix_cache_hits_total|vllm:prefix_cache_queries_total",
            "vllm:prefix_cache_hits|vllm:prefix_cache_queries",
            "vllm:gpu_prefix_cache_hits_total|vllm:gpu_prefix_cache_queries_total",
            "vllm:gpu_prefix_cache_hits|vllm:gpu_prefix_cache_queries",
        ),
    ),
    Signal("cache_config", "info", ("vllm:cache_config_info",)),
    Signal("arrivals", "dispersion", ("vllm:time_to_first_token_seconds_count",)),
)
SIGNALS_BY_KEY = {s.key: s for s in SIGNALS}
REQUIRED_SIGNAL = "requests"


# ------------------------------------------------------------------------------------ escaping

# Go's regexp.QuoteMeta set: RE2 rejects escapes of other characters (e.g. `\ `), so Python's
# re.escape would produce regexes Prometheus refuses.
_RE2_META = frozenset("\\.+*?()|[]{}^$")


def quote_meta(value: str) -> str:
    """`value` as an RE2 regex that matches exactly it (Prometheus anchors regexes)."""
    return "".join("\\" + c if c in _RE2_META else c for c in value)


def string_literal(value: str) -> str:
    """`value` as a double-quoted PromQL string literal (Go escaping rules).

    Backslash, quote and every control character are escaped, so the literal can never end early
    or span lines whatever the value is. Code points UTF-8 cannot carry (lone surrogates) become
    U+FFFD: no label value can contain them, so nothing that could match is lost.
    """
    out = ['"']
    for ch in value:
        code = ord(ch)
        if ch == "\\":
            out.append("\\\\")
        elif ch == '"':
            out.append('\\"')
        elif ch == "\n":
            out.append("\\n")
        elif ch == "\r":
            out.append("\\r")
        elif ch == "\t":
            out.append("\\t")
        elif code < 0x20 or code == 0x7F:
            out.append(f"\\x{code:02x}")
        elif 0xD800 <= code <= 0xDFFF:
            out.append("\\ufffd")
        elif not ch.isprintable():
            out.append(f"\\u{code:04x}" if code <= 0xFFFF else f"\\U{code:08x}")
        else:
            out.append(ch)
    out.append('"')
    return "".join(out)


_LABEL_NAME = re.compile(r"[a-zA-Z_][a-zA-Z0-9_]*")


def label_name(name: str) -> str:
    """`name` if it is a valid Prometheus label name; label names cannot be quoted in 2.x, so
    anything else would be injected into the query."""
    if not _LABEL_NAME.fullmatch(name):
        raise ValueError(f"not a Prometheus label name: {name!r}")
    return name


def matcher(label: str, values: Iterable[str]) -> str:
    """`label="v"` for one value, `label=~"v1|v2"` (each quoted) for several."""
    label_name(label)
    vs = sorted(set(values))
    if not vs:
        raise ValueError(f"no values for label {label}")
    if len(vs) == 1:
        return f"{label}={string_literal(vs[0])}"
    return f"{label}=~{string_literal('|'.join(quote_meta(v) for v in vs))}"


# ------------------------------------------------------------------------------ name discovery


def spellings(name: str) -> tuple[str, ...]:
    """A `vllm:` name and its `vllm_` escaping (prometheus_client >= 0.23 scraped by Prometheus
    2.x with OpenMetrics stores the underscore form; client_python #1177)."""
    if name.startswith("vllm:"):
        return (name, "vllm_" + name[len("vllm:") :])
    return (name,)


def _series_needed(kind: SignalKind, name: str) -> tuple[str, ...]:
    if kind == "histogram":
        return (name + "_bucket", name + "_sum")
    if kind == "ratio":
        return tuple(name.split("|"))
    return (name,)


@dataclass(frozen=True)
class MetricNames:
    """The exported spellings chosen for each signal key; a missing key means not exported.

    A signal may have two spellings at once (`vllm:x` from some pods, `vllm_x` from pods whose
    prometheus_client escapes): one pod only ever exports one of them, so queries read both.
    """

    names: Mapping[str, tuple[str, ...]] = field(default_factory=dict)

    def get(self, key: str) -> str | None:
        found = self.names.get(key)
        return found[0] if found else None

    def spellings(self, key: str) -> tuple[str, ...]:
        return tuple(self.names.get(key, ()))

    def __bool__(self) -> bool:
        return bool(self.names)


def resolve_names(available: Iterable[str]) -> MetricNames:
    """For each signal, the first candidate (newest name first) of which some spelling has all
    its series among `available`, with every such spelling (colon first).

    Older generations are never mixed in: vLLM exported deprecated names next to their
    replacements for a while, and reading both would count every event twice.
    """
    have = set(available)
    chosen: dict[str, tuple[str, ...]] = {}
    for signal in SIGNALS:
        for candidate in signal.candidates:
            parts = candidate.split("|")
            present = tuple(
                name
                for name in ("|".join(v) for v in zip(*(spellings(p) for p in parts), strict=True))
                if all(x in have for x in _series_needed(signal.kind, name))
            )
            if present:
                chosen[signal.key] = present
                break
    return MetricNames(chosen)


# -------------------------------------------------------------------------------------- queries


@dataclass(frozen=True)
class Selector:
    """Which series one batched query reads: the union of several deployments' pods."""

    namespaces: tuple[str, ...]
    pods: tuple[str, ...]
    namespace_label: str = "namespace"
    pod_label: str = "pod"

    def matchers(self) -> str:
        return (
            matcher(self.namespace_label, self.namespaces)
            + ", "
            + matcher(self.pod_label, self.pods)
        )

    def render(self) -> str:
        return "{" + self.matchers() + "}"

    @property
    def by(self) -> str:
        return f"{self.namespace_label}, {self.pod_label}, {MODEL_LABEL}"


def _tagged(expr: str, part: str) -> str:
    return f'label_replace({expr}, "{PART_LABEL}", "{part}", "{PART_LABEL}", "")'


def series(names: str | Sequence[str], suffix: str, matchers: str) -> str:
    """`name_suffix{matchers}`, or a `__name__` regex over several spellings."""
    ns = [names] if isinstance(names, str) else list(names)
    if len(ns) == 1:
        return f"{ns[0]}{suffix}{{{matchers}}}"
    return "{" + matcher("__name__", [n + suffix for n in ns]) + f", {matchers}}}"


def build_query(signal: Signal, names: str | Sequence[str], sel: Selector, window_s: int) -> str:
    """The one PromQL expression that reads `signal` for every pod `sel` selects; `names` are
    the spellings of the chosen metric name."""
    spelled = [names] if isinstance(names, str) else list(names)
    m = sel.matchers()
    w = f"[{window_s}s]"
    by = sel.by
    if signal.kind == "histogram":
        buckets = f"sum by ({by}, le) (increase({series(spelled, '_bucket', m)}{w}))"
        total = f"sum by ({by}) (increase({series(spelled, '_sum', m)}{w}))"
        return f'{buckets} or label_replace({total}, "le", "{SUM_LE}", "le", "")'
    if signal.kind == "counter":
        return f"sum by ({by}) (increase({series(spelled, '', m)}{w}))"
    if signal.kind in ("gauge_mean", "gauge_sum"):
        # Per pod: a data-parallel pod has one series per engine; requests add up across
        # engines, KV usage is a fraction of each engine's own cache so it averages.
        agg_mean, agg_max = ("avg", "max") if signal.kind == "gauge_mean" else ("sum", "sum")
        sel_text = series(spelled, "", m)
        mean = f"{agg_mean} by ({by}) (avg_over_time({sel_text}{w}))"
        peak = f"{agg_max} by ({by}) (max_over_time({sel_text}{w}))"
        return f"{_tagged(mean, 'mean')} or {_tagged(peak, 'max')}"
    if signal.kind == "ratio":
        nums = [n.split("|")[0] for n in spelled]
        dens = [n.split("|")[1] for n in spelled]
        hits = f"sum by ({by}) (increase({series(nums, '', m)}{w}))"
        queries = f"sum by ({by}) (increase({series(dens, '', m)}{w}))"
        return f"{_tagged(hits, 'num')} or {_tagged(queries, 'den')}"
    if signal.kind == "dispersion":
        return _dispersion_query(series(spelled, "", m), by, window_s)
    # info: every label matters and the set varies by version, so read the raw series.
    return f"last_over_time({series(spelled, '', m)}{w})"


def _dispersion_step(window_s: int) -> int:
    """Seconds between the burstiness subquery's samples: about DISPERSION_STEPS a window."""
    return max(1, window_s // DISPERSION_STEPS)


def _dispersion_query(counter: str, by: str, window_s: int) -> str:
    """Per pod, for each of the window's DISPERSION_SEGMENTS parts: the variance and the mean
    of its counts per scrape interval (a counter reset counts 0, not minus the total); and
    how many scrapes the whole window holds."""
    step = _dispersion_step(window_s)
    seg = max(step, window_s // DISPERSION_SEGMENTS)
    counts = f"(sum by ({by}) (clamp_min(idelta({counter}[{IDELTA_RANGE_S}s]), 0)))"
    parts = [("n", f"max by ({by}) (count_over_time({counter}[{window_s}s]))")]
    for j in range(DISPERSION_SEGMENTS):
        back = f" offset {seg * j}s" if j else ""
        parts.append((f"var{j}", f"stdvar_over_time({counts}[{seg}s:{step}s]{back})"))
        parts.append((f"mean{j}", f"avg_over_time({counts}[{seg}s:{step}s]{back})"))
    return " or ".join(_tagged(expr, part) for part, expr in parts)


def build_queries(names: MetricNames, sel: Selector, window_s: int) -> dict[str, str]:
    """signal key -> PromQL, for the signals whose names were discovered."""
    out: dict[str, str] = {}
    for signal in SIGNALS:
        spelled = names.spellings(signal.key)
        if spelled:
            out[signal.key] = build_query(signal, spelled, sel, window_s)
    return out


def discovery_query_for_targets(
    running_names: str | Sequence[str],
    namespace: str | None,
    pod_regex: str | None,
    labels: Mapping[str, str] | None,
    window_s: int,
    namespace_label: str = "namespace",
    pod_label: str = "pod",
) -> str:
    """Pods that exported vLLM's running gauge lately, for `recommend` without Kubernetes.

    `pod_regex` is the user's own regex (only string-escaped); every other value is literal.
    """
    matchers: list[str] = []
    if namespace is not None:
        matchers.append(f"{label_name(namespace_label)}={string_literal(namespace)}")
    if pod_regex is not None:
        matchers.append(f"{label_name(pod_label)}=~{string_literal(pod_regex)}")
    for k, v in sorted((labels or {}).items()):
        matchers.append(f"{label_name(k)}={string_literal(v)}")
    matchers.append(f'{pod_label}!=""')
    sel = series(running_names, "", ", ".join(matchers))
    by = f"{namespace_label}, {pod_label}, {MODEL_LABEL}"
    return f"count by ({by}) (last_over_time({sel}[{window_s}s]))"


def last_seen_query(
    running_names: str | Sequence[str],
    namespace: str,
    pods: Iterable[str],
    window_s: int,
    namespace_label: str = "namespace",
    pod_label: str = "pod",
) -> str:
    """When any of `pods` last exported vLLM's running gauge within the window (a timestamp).

    `recommend` asks it of pods that are gone, to start its window after them.
    """
    matchers = f"{label_name(namespace_label)}={string_literal(namespace)}, "
    matchers += matcher(pod_label, pods)
    sel = series(running_names, "", matchers)
    return f"max(max_over_time(timestamp({sel})[{window_s}s:]))"


# ------------------------------------------------------------------------------------- targets


@dataclass(frozen=True)
class SnapshotTarget:
    """One VLLMDeployment to observe this cycle (the operator knows its pods from Kubernetes).

    `pods` are the ready pods of the current revision and `since` when the last of them became
    ready: the window never reaches back before it, so a snapshot never mixes revisions.
    `slo` is (ttft, itl, e2e). `pods_since` is when the last of `pods` became ready, without
    what else moves `since` (a settled replica count, a canary's fair window): the pods' age,
    which tells how many long requests a young window could not have seen finish.
    """

    namespace: str
    name: str
    pods: tuple[str, ...]
    since: datetime | None
    knobs: Knobs | None
    revision: str | None
    window_s: float
    slo: tuple[SLOTarget | None, SLOTarget | None, SLOTarget | None] = (None, None, None)
    model_name: str | None = None
    pods_since: datetime | None = None

    @property
    def key(self) -> tuple[str, str]:
        return (self.namespace, self.name)


def effective_window(
    target: SnapshotTarget, now: datetime, grid_s: float, min_window_s: float
) -> tuple[int, str | None]:
    """(window in whole seconds, None) or (0, why there is no usable window yet).

    A window clipped by the revision's age is rounded DOWN to `grid_s`, so that deployments of
    similar age share queries and a window never reaches back before `since`.
    """
    window = float(target.window_s)
    if window < min_window_s:
        return 0, f"window too short: {window:.0f}s < {min_window_s:.0f}s"
    if target.since is None:
        return math.floor(window), None
    age = (now - target.since).total_seconds()
    if age < min_window_s:
        return 0, (
            f"waiting for data from the new revision: pods ready {max(0.0, age):.0f}s ago, "
            f"need at least {min_window_s:.0f}s"
        )
    if age >= window:
        return math.floor(window), None
    # Clipped by the revision's age: every deployment rolled out lately has its own age, so
    # round down to the grid to let them share queries.
    rounded = math.floor(age / max(1.0, grid_s)) * max(1.0, grid_s)
    return int(rounded if rounded >= min_window_s else math.floor(age)), None


# ------------------------------------------------------------------------------------ assembly


@dataclass(frozen=True)
class Sample:
    labels: Mapping[str, str]
    value: float


@dataclass(frozen=True)
class QueryFailure:
    """A query that got no answer; `unreachable` distinguishes a dead server from a bad query."""

    message: str
    unreachable: bool = False


QueryOutcome = list[Sample] | QueryFailure


def parse_vector(result: Any) -> list[Sample]:
    """Samples of an instant-vector answer (`data.result`), dropping NaN, Inf and junk.

    A NaN is what Prometheus returns for 0/0 or an empty histogram; it means "no data", so it is
    dropped rather than turned into a number.
    """
    out: list[Sample] = []
    if not isinstance(result, list):
        return out
    for item in result:
        sample = parse_sample(item)
        if sample is not None:
            out.append(sample)
    return out


def parse_sample(item: Any) -> Sample | None:
    """One `{"metric": {...}, "value": [t, "v"]}`, or None when any part of it is malformed.

    Each sample stands alone: Prometheus only ever sends string label values, so a sample with
    any other (a number, a list, null: a broken proxy or a hostile server) is dropped by
    itself, and never stops the answer from being read for every other deployment.
    """
    if not isinstance(item, dict):
        return None
    metric = item.get("metric")
    value = item.get("value")
    if not isinstance(metric, dict) or not isinstance(value, list | tuple) or len(value) != 2:
        return None
    if not all(isinstance(k, str) and isinstance(v, str) for k, v in metric.items()):
        return None
    if not isinstance(value[1], str | int | float) or isinstance(value[1], bool):
        return None
    try:
        v = float(value[1])
    except (TypeError, ValueError, OverflowError):
        return None
    if not math.isfinite(v):
        return None
    return Sample(metric, v)


@dataclass(frozen=True)
class PodIndex:
    """One signal's samples keyed by (namespace, pod), built once per cycle: assembling
    thousands of deployments then costs a lookup per pod, not a scan of every answer."""

    by_pod: Mapping[tuple[str, str], Sequence[Sample]]

    @classmethod
    def build(cls, samples: Iterable[Sample], namespace_label: str, pod_label: str) -> PodIndex:
        index: dict[tuple[str, str], list[Sample]] = {}
        for s in samples:
            pod = s.labels.get(pod_label)
            if pod is not None:
                index.setdefault((s.labels.get(namespace_label, ""), pod), []).append(s)
        return cls(index)


def index_outcomes(
    outcomes: Mapping[str, QueryOutcome], namespace_label: str = "namespace", pod_label: str = "pod"
) -> dict[str, PodIndex | QueryFailure]:
    return {
        key: o if isinstance(o, QueryFailure) else PodIndex.build(o, namespace_label, pod_label)
        for key, o in outcomes.items()
    }


def _rows_for(
    index: PodIndex, target: SnapshotTarget, check_model: bool = True
) -> dict[str, list[Sample]]:
    out: dict[str, list[Sample]] = {}
    for pod in dict.fromkeys(target.pods):
        for s in index.by_pod.get((target.namespace, pod), ()):
            if check_model and target.model_name is not None:
                model = s.labels.get(MODEL_LABEL, "")
                if model not in ("", target.model_name):
                    continue
            out.setdefault(pod, []).append(s)
    return out


def _histogram(
    by_pod: Mapping[str, Sequence[Sample]],
) -> tuple[list[tuple[float, float]], float | None]:
    """Cumulative buckets summed over pods, and the summed `_sum` (None when absent).

    Only bounds every contributing pod has are kept, so pods with different (custom) bucket
    layouts cannot produce a non-cumulative sum; counts are made monotone, as PromQL does,
    because increase() extrapolates each bucket separately.
    """
    per_pod: list[dict[float, float]] = []
    total_sum: float | None = None
    for samples in by_pod.values():
        buckets: dict[float, float] = {}
        for s in samples:
            le = s.labels.get("le")
            if le == SUM_LE:
                if s.value >= 0:
                    total_sum = (total_sum or 0.0) + s.value
                continue
            if le is None or s.value < 0:
                continue
            try:
                bound = float(le)
            except ValueError:
                continue
            if bound < 0 or (math.isfinite(bound) and bound > MAX_PLAUSIBLE_LATENCY_S * 1e3):
                continue  # no histogram of ours has such a bucket: a corrupt series
            buckets[bound] = buckets.get(bound, 0.0) + s.value
        if buckets:
            per_pod.append(buckets)
    if not per_pod:
        return [], total_sum
    common = set(per_pod[0])
    for b in per_pod[1:]:
        common &= set(b)
    if math.inf not in common:
        return [], total_sum
    out: list[tuple[float, float]] = []
    running = 0.0
    for bound in sorted(common):
        running = max(running, sum(b[bound] for b in per_pod))
        out.append((bound, running))
    return out, total_sum


def _count(buckets: Sequence[tuple[float, float]]) -> float:
    return buckets[-1][1] if buckets else 0.0


def _latency(
    buckets: Sequence[tuple[float, float]], total: float | None, slo: SLOTarget | None
) -> tuple[LatencySummary, float | None]:
    """Percentiles in ms (histograms are in seconds) and the SLO attainment."""
    count = _count(buckets)
    if count <= 0:
        return LatencySummary(), None

    def ms(q: float) -> float | None:
        v = histogram_quantile(q, buckets)
        plausible = v is not None and math.isfinite(v) and 0 <= v <= MAX_PLAUSIBLE_LATENCY_S
        return v * 1000.0 if plausible and v is not None else None

    p50, p90, p95, p99 = (ms(q) for q in PERCENTILES)
    at_slo = ms(slo.percentile / 100.0) if slo is not None else None
    mean_s = total / count if total is not None else None
    mean = mean_s * 1000.0 if mean_s is not None and mean_s <= MAX_PLAUSIBLE_LATENCY_S else None
    attainment = fraction_below(slo.threshold_ms / 1000.0, buckets) if slo is not None else None
    cumulative = tuple((b * 1000.0, c) for b, c in sorted(buckets))
    summary = LatencySummary(
        p50_ms=p50,
        p90_ms=p90,
        p95_ms=p95,
        p99_ms=p99,
        at_slo_ms=at_slo,
        mean_ms=mean,
        buckets=cumulative,
    )
    return summary, attainment


def _lengths(buckets: Sequence[tuple[float, float]], total: float | None) -> LengthSummary:
    count = _count(buckets)
    if count <= 0:
        return LengthSummary()
    mean = total / count if total is not None else None
    return LengthSummary(
        mean=mean if mean is not None and mean <= MAX_PLAUSIBLE_TOKENS else None,
        p50=histogram_quantile(0.5, buckets),
        p90=histogram_quantile(0.9, buckets),
        buckets=tuple(sorted(buckets)),
    )


def _parts(by_pod: Mapping[str, Sequence[Sample]], part: str) -> dict[str, float]:
    out: dict[str, float] = {}
    for pod, samples in by_pod.items():
        for s in samples:
            if s.labels.get(PART_LABEL) == part:
                out[pod] = out.get(pod, 0.0) + s.value
    return out


def _gauge(
    by_pod: Mapping[str, Sequence[Sample]], upper: float | None = None
) -> tuple[float | None, float | None]:
    """(mean over pods of their time averages, max over pods of their maxima); values outside
    [0, upper] are impossible for these gauges and are dropped as corrupt."""

    def ok(v: float) -> bool:
        return v >= 0 and (upper is None or v <= upper)

    means = [v for v in _parts(by_pod, "mean").values() if ok(v)]
    peaks = [v for v in _parts(by_pod, "max").values() if ok(v)]
    return (sum(means) / len(means) if means else None, max(peaks) if peaks else None)


def _dispersion(by_pod: Mapping[str, Sequence[Sample]], window_s: int) -> tuple[float | None, int]:
    """(variance over mean of the pods' counts per scrape interval, pooled: the sum of the
    variances over the sum of the means; how many intervals it rests on). Only pods whose load
    held steady count: a change of load inside the window is not burstiness.

    Per pod, the variance is the mean of the segments' own, each corrected for its own mean
    (times m / (m - 1) for m intervals). A pod whose segment means spread more than
    DISPERSION_STEADY times what Poisson counts give them (their mean over m) changed load
    inside the window, and is left out; so is, now and then, a steady pod with strong bursts,
    which leaves the model at Poisson, as it was. Without the check, windows over
    chat-8b-h100's load step (16 to 28 req/s per pod) read as a dispersion of 8 to 40; with a
    check against the window's own variance, 5 intervals a segment let one through at 2.6.

    The means' spread is taken about the straight line through them (`_off_trend`), so a ramp
    passes. On bursty-8b-h100 (a ramp from 12 to 40 req/s per pod over 90 min, each pod's
    counts at a true 2.17) the spread about their mean left out 63 of 194 pod-windows in the
    first 50 minutes; about the line, 30 (their own dispersions averaged 2.0 either way)."""
    k = DISPERSION_SEGMENTS
    scrapes = _parts(by_pod, "n")
    seg_var = [_parts(by_pod, f"var{j}") for j in range(k)]
    seg_mean = [_parts(by_pod, f"mean{j}") for j in range(k)]
    steps = window_s // _dispersion_step(window_s)  # the most intervals the query samples
    total_var = total_mean = 0.0
    intervals = 0
    for pod, n_scrapes in scrapes.items():
        n = min(int(n_scrapes) - 1, steps)
        vs = [v[pod] for v in seg_var if pod in v]
        ms = [m[pod] for m in seg_mean if pod in m]
        if len(vs) < k or len(ms) < k or n < k + 2 or not all(map(math.isfinite, vs + ms)):
            continue
        mean = sum(ms) / k
        per_segment = n / k
        if mean <= 0 or min(vs) < 0 or _off_trend(ms) > DISPERSION_STEADY * mean / per_segment:
            continue  # no arrivals, a corrupt answer, or the load moved
        total_var += sum(vs) / k * per_segment / (per_segment - 1)
        total_mean += mean
        intervals += n - k
    if total_mean <= 0:
        return None, 0
    return total_var / total_mean, intervals


def _off_trend(means: Sequence[float]) -> float:
    """The variance of the segments' means about the straight line through them (k - 2
    degrees of freedom): a steady ramp of load is load, not burstiness, and a step is not a
    line."""
    k = len(means)
    centre = (k - 1) / 2.0
    xs = [j - centre for j in range(k)]
    mean = sum(means) / k
    slope = sum(x * (m - mean) for x, m in zip(xs, means, strict=True)) / sum(x * x for x in xs)
    return sum((m - mean - slope * x) ** 2 for x, m in zip(xs, means, strict=True)) / (k - 2)


def _int_label(labels: Mapping[str, str], name: str) -> int | None:
    try:
        return int(float(labels[name]))
    except (KeyError, ValueError, OverflowError):
        return None


def _float_label(labels: Mapping[str, str], name: str) -> float | None:
    try:
        v = float(labels[name])
    except (KeyError, ValueError):
        return None
    return v if math.isfinite(v) else None


def kv_cache_info(labels: Mapping[str, str]) -> KVCacheInfo:
    """Read the cache_config_info labels by name: the label set changes between versions and
    every value is str() of a Python value, "None" included (vLLM config/cache.py)."""
    return KVCacheInfo(
        num_gpu_blocks=_int_label(labels, "num_gpu_blocks"),
        block_size=_int_label(labels, "block_size"),
        kv_cache_size_tokens=_int_label(labels, "kv_cache_size_tokens"),
        gpu_memory_utilization=_float_label(labels, "gpu_memory_utilization"),
        kv_cache_memory_bytes=_int_label(labels, "kv_cache_memory_bytes"),
    )


def _pod_list(pods: Iterable[str], limit: int = 5) -> str:
    ps = sorted(pods)
    text = ",".join(ps[:limit])
    return text + (f",... ({len(ps)} pods)" if len(ps) > limit else "")


def assemble(
    target: SnapshotTarget,
    now: datetime,
    window_s: int,
    outcomes: Mapping[str, QueryOutcome | PodIndex],
    *,
    rate_scale: float = 1.0,
    namespace_label: str = "namespace",
    pod_label: str = "pod",
) -> Snapshot:
    """One target's Snapshot from the cycle's shared query outcomes (signal key -> outcome,
    raw or already indexed with `index_outcomes`).

    Never raises for bad data: a missing or failed signal leaves its fields None; only the
    request counter is required, because without it nothing else can be weighed.
    """
    required = outcomes.get(REQUIRED_SIGNAL)
    if required is None:
        return Snapshot.unavailable(now, window_s, "no vLLM request counter found in Prometheus")
    if isinstance(required, QueryFailure):
        return Snapshot.unavailable(now, window_s, required.message)

    def rows(key: str, check_model: bool = True) -> dict[str, list[Sample]]:
        o = outcomes.get(key)
        if o is None or isinstance(o, QueryFailure):
            return {}
        if not isinstance(o, PodIndex):
            o = PodIndex.build(o, namespace_label, pod_label)
        return _rows_for(o, target, check_model)

    # A counter reset is handled by increase(); what still comes out negative or beyond any
    # engine's speed is a corrupt series, and that pod counts as missing rather than as data.
    limit = MAX_PLAUSIBLE_RATE_PER_POD * window_s * max(1.0, rate_scale)
    completed_by_pod: dict[str, float] = {}
    for pod, ss in rows(REQUIRED_SIGNAL).items():
        values = [s.value for s in ss]
        if values and all(v >= 0 for v in values) and sum(values) <= limit:
            completed_by_pod[pod] = sum(values)
    if not completed_by_pod:
        where = f"pods {_pod_list(target.pods)} in namespace {target.namespace}"
        others = sorted(
            {
                s.labels.get(MODEL_LABEL, "")
                for ss in rows(REQUIRED_SIGNAL, check_model=False).values()
                for s in ss
            }
        )
        if others:  # the usual cause: --served-model-name differs from what the spec says
            shown = [o[:MAX_MODEL_NAME_SHOWN] for o in others[:MAX_MODEL_NAMES_SHOWN]]
            more = len(others) - len(shown)
            return Snapshot.unavailable(
                now,
                window_s,
                f"no vllm metrics for model {target.model_name} on {where}: they export "
                f"model_name {', '.join(shown)}" + (f" and {more} more" if more > 0 else ""),
            )
        return Snapshot.unavailable(
            now, window_s, f"no vllm metrics for {where} in the last {window_s}s"
        )
    missing = set(target.pods) - set(completed_by_pod)
    scale = rate_scale if rate_scale > 0 else 1.0
    completed = sum(completed_by_pod.values())

    slo_ttft, slo_itl, slo_e2e = target.slo
    ttft, ttft_att = _latency(*_histogram(rows("ttft")), slo_ttft)
    itl, itl_att = _latency(*_histogram(rows("itl")), slo_itl)
    e2e, e2e_att = _latency(*_histogram(rows("e2e")), slo_e2e)
    queue, _ = _latency(*_histogram(rows("queue_time")), None)
    prefill, _ = _latency(*_histogram(rows("prefill_time")), None)
    prompt = _lengths(*_histogram(rows("prompt_len")))
    generation = _lengths(*_histogram(rows("generation_len")))
    it_buckets, it_sum = _histogram(rows("iteration_tokens"))
    it_count = _count(it_buckets)
    iteration_mean = it_sum / it_count if it_sum is not None and it_count > 0 else None
    if iteration_mean is not None and iteration_mean > MAX_PLAUSIBLE_TOKENS:
        iteration_mean = None

    preempt_rows = rows("preemptions")
    preempted = sum(
        total for ss in preempt_rows.values() if 0 <= (total := sum(s.value for s in ss)) <= limit
    )

    kv_mean, kv_max = _gauge(rows("kv_usage"), upper=1.0)
    running_mean, running_max = _gauge(rows("running"), upper=MAX_PLAUSIBLE_REQUESTS_PER_POD)
    waiting_mean, waiting_max = _gauge(rows("waiting"), upper=MAX_PLAUSIBLE_REQUESTS_PER_POD)

    prefix = rows("prefix_cache")
    hits = sum(v for v in _parts(prefix, "num").values() if v >= 0)
    queried = sum(v for v in _parts(prefix, "den").values() if v >= 0)
    hit_rate = min(1.0, hits / queried) if queried > 0 else None

    dispersion, intervals = _dispersion(rows("arrivals"), window_s)

    kv = KVCacheInfo()
    info = rows("cache_config", check_model=False)
    for pod in sorted(info):
        kv = kv_cache_info(info[pod][0].labels)
        break

    reason = f"no metrics from pods {_pod_list(missing)}" if missing else ""
    return Snapshot(
        time=now,
        window_s=float(window_s),
        available=True,
        reason=reason,
        revision=target.revision,
        knobs=target.knobs,
        num_pods=len(completed_by_pod),
        request_rate=completed / window_s / scale,
        completed_requests=round(completed),
        ttft=ttft,
        itl=itl,
        e2e=e2e,
        queue_time=queue,
        prefill_time=prefill,
        ttft_attainment=ttft_att,
        itl_attainment=itl_att,
        e2e_attainment=e2e_att,
        kv_usage_mean=kv_mean,
        kv_usage_max=kv_max,
        preemption_rate=preempted / window_s / scale,
        running_mean=running_mean,
        running_max=running_max,
        waiting_mean=waiting_mean,
        waiting_max=waiting_max,
        prompt_len=prompt,
        generation_len=generation,
        prefix_cache_hit_rate=hit_rate,
        iteration_tokens_mean=iteration_mean,
        steps_per_s=it_count / window_s / scale / len(completed_by_pod) if it_count > 0 else None,
        kv_cache=kv,
        arrival_dispersion=dispersion,
        arrival_intervals=intervals,
        pods_age_s=None if target.pods_since is None else (now - target.pods_since).total_seconds(),
    )
