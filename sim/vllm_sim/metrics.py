"""vLLM's Prometheus metrics, with its names, labels and buckets, cheap enough for bulk updates.

The engine observes millions of inter-token latencies per simulated minute, more than
prometheus_client's metric objects (a lock and a method call per observation) can take, so the
values accumulate here (histograms bin a pending buffer with numpy; counters are plain dicts;
per-request observations are buffered and folded in on read). They are exposed through
prometheus_client itself, as vLLM exposes its own: a `Collector` yields the metric families on
each scrape into a `CollectorRegistry`, and `exposition()` answers like prometheus_client's
`make_asgi_app` that vLLM mounts on /metrics (`vllm/entrypoints/serve/instrumentator/metrics.py`):
the Accept header picks text 0.0.4 or OpenMetrics (whose negotiation, with prometheus_client >=
0.23 and a Prometheus 2.x that sends no `escaping=`, writes `vllm_` instead of `vllm:`, as a real
pod does), `name[]` restricts the families, and gzip is used when accepted. Counters and
histograms carry `_created` samples like prometheus_client's own (unless the environment sets
PROMETHEUS_DISABLE_CREATED_SERIES=true). Names, meanings and buckets: vLLM
v1/metrics/loggers.py, buckets.py, docs/usage/metrics.md.
"""

from __future__ import annotations

import gzip
import itertools
import math
import os
import time
from bisect import bisect_left
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field

import numpy as np
import numpy.typing as npt
from prometheus_client import (
    CollectorRegistry,
    GCCollector,
    PlatformCollector,
    ProcessCollector,
)
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.exposition import choose_encoder, gzip_accepted
from prometheus_client.registry import Collector
from prometheus_client.samples import Sample
from prometheus_client.utils import floatToGoString

# vllm/v1/metrics/buckets.py.
TTFT_BUCKETS = (
    0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
    20.0, 40.0, 80.0, 160.0, 640.0, 2560.0,
)  # fmt: skip
ITL_BUCKETS = (
    0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
    40.0, 80.0,
)  # fmt: skip
REQUEST_LATENCY_BUCKETS = (
    0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0,
    480.0, 960.0, 1920.0, 7680.0,
)  # fmt: skip
ITERATION_TOKENS_BUCKETS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)
REQUEST_PARAMS_N_BUCKETS = (1, 2, 5, 10, 20)
REQUEST_NUM_PREEMPTIONS_BUCKETS = (1, 2, 3, 4, 5, 10, 20)

FINISH_REASONS = ("stop", "length", "abort", "error", "repetition")
PROMPT_SOURCES = ("local_compute", "local_cache_hit", "external_kv_transfer")
SLEEP_STATES = ("awake", "weights_offloaded", "discard_all")

FloatArray = npt.NDArray[np.float64]


def build_1_2_5_buckets(max_value: int) -> list[int]:
    """1, 2, 5, 10, 20, 50, ... up to max_value (vLLM's build_1_2_5_buckets)."""
    out: list[int] = []
    exponent = 0
    while True:
        for m in (1, 2, 5):
            v = m * 10**exponent
            if v > max_value:
                return out
            out.append(v)
        exponent += 1


@dataclass
class Counter:
    name: str  # as created in vLLM (exposed with `_total`)
    help: str
    extra_label: str | None = None
    values: dict[str, float] = field(default_factory=dict)

    def inc(self, amount: float = 1.0, label: str = "") -> None:
        self.values[label] = self.values.get(label, 0.0) + amount

    def value(self, label: str = "") -> float:
        return self.values.get(label, 0.0)


@dataclass
class Gauge:
    name: str
    help: str
    extra_label: str | None = None
    values: dict[str, float] = field(default_factory=dict)

    def set(self, value: float, label: str = "") -> None:
        self.values[label] = float(value)


class Histogram:
    """Cumulative-bucket histogram; observations may be buffered and binned in bulk."""

    def __init__(self, name: str, help: str, buckets: Sequence[float]) -> None:
        self.name = name
        self.help = help
        self.bound_list = [float(b) for b in buckets]
        self.bounds = np.asarray(self.bound_list, dtype=np.float64)
        self.counts = [0] * (len(self.bound_list) + 1)  # last: above all bounds
        self.sum = 0.0
        self._pending: list[FloatArray] = []
        self._pending_n = 0

    def observe(self, value: float) -> None:
        # Prometheus buckets are inclusive upper bounds: le=b counts v <= b.
        self.counts[bisect_left(self.bound_list, value)] += 1
        self.sum += value

    def observe_repeated(self, value: float, n: int) -> None:
        if n > 0:
            self.counts[bisect_left(self.bound_list, value)] += n
            self.sum += value * n

    def observe_many(self, values: FloatArray) -> None:
        if values.size:
            self._pending.append(values)
            self._pending_n += values.size
            if self._pending_n > 65536:
                self.flush()

    def observe_many_weighted(self, values: FloatArray, weight: int) -> None:
        """Each value observed `weight` times (a decode step's gap, once per running request)."""
        if values.size < 64:  # a Python loop beats numpy's call overhead on short runs
            for v in values.tolist():
                self.observe_repeated(v, weight)
            return
        if weight > 0:
            self.add_values(values, weight)

    def add_values(self, values: FloatArray, weight: int = 1) -> None:
        """Bin an array at once, each value `weight` times: every bulk path ends here."""
        idx = np.searchsorted(self.bounds, values, side="left")
        binned = np.bincount(idx, minlength=len(self.counts)) * weight
        self.counts = [a + b for a, b in zip(self.counts, binned.tolist(), strict=True)]
        self.sum += float(values.sum()) * weight

    def flush(self) -> None:
        if not self._pending:
            return
        vals = np.concatenate(self._pending) if len(self._pending) > 1 else self._pending[0]
        self._pending.clear()
        self._pending_n = 0
        self.add_values(vals)

    @property
    def count(self) -> int:
        self.flush()
        return sum(self.counts)

    def bucket_counts(self) -> list[tuple[float, int]]:
        """(upper bound, cumulative count), +Inf last."""
        self.flush()
        out = []
        cum = 0
        for bound, c in zip([*self.bound_list, math.inf], self.counts, strict=True):
            cum += c
            out.append((bound, cum))
        return out


# Hidden-metric rule (see VllmMetrics): name -> first vLLM minor version that no longer offered it
# even behind --show-hidden-metrics-for-version (vLLM v1/metrics/loggers.py).
_REMOVED_IN = {
    "vllm:gpu_cache_usage_perc": (0, 14),
    "vllm:gpu_prefix_cache_queries": (0, 14),
    "vllm:gpu_prefix_cache_hits": (0, 14),
    "vllm:time_per_output_token_seconds": (0, 18),
}


def _parse_version(v: str) -> tuple[int, int]:
    parts = v.strip().lstrip("v").split(".")
    try:
        return int(parts[0]), int(parts[1]) if len(parts) > 1 else 0
    except ValueError as exc:
        raise ValueError(f"invalid --show-hidden-metrics-for-version {v!r}") from exc


class VllmMetrics:
    """The engine's metrics as vLLM 0.33's PrometheusStatLogger exposes them.

    Removed names come back only with `show_hidden_metrics_for_version` set to a version older
    than the one that dropped them for good: vllm:gpu_cache_usage_perc and
    vllm:gpu_prefix_cache_{queries,hits} for versions < 0.14, vllm:time_per_output_token_seconds
    for versions < 0.18 (vLLM 0.33 itself has no hidden metric left; this lets a tuner be tested
    against the names older deployments still export).
    """

    def __init__(
        self,
        model_name: str,
        max_model_len: int,
        cache_config_labels: Sequence[tuple[str, str]],
        show_hidden_metrics_for_version: str | None = None,
    ) -> None:
        self.base = (("model_name", model_name), ("engine", "0"))
        self.created = time.time()  # the `_created` samples: when vLLM made its metrics
        self._registry: CollectorRegistry | None = None
        self.cache_config_labels = list(cache_config_labels)
        self.gauge_provider: Callable[[], tuple[int, int, float]] | None = None
        hidden: set[str] = set()
        if show_hidden_metrics_for_version:
            wanted = _parse_version(show_hidden_metrics_for_version)
            hidden = {n for n, removed in _REMOVED_IN.items() if wanted < removed}
        self.hidden = hidden
        self.tpot_hidden = "vllm:time_per_output_token_seconds" in hidden
        self.finished_rows: list[tuple[float, ...]] = []
        self.first_rows: list[tuple[float, int, int]] = []
        self.prefix_rows: list[tuple[int, int]] = []  # (queried, hit) tokens per admission
        tok = build_1_2_5_buckets(max_model_len)
        H = Histogram
        self.ttft = H(
            "vllm:time_to_first_token_seconds", "Histogram of time to first token in seconds.",
            TTFT_BUCKETS,
        )  # fmt: skip
        self.itl = H(
            "vllm:inter_token_latency_seconds", "Histogram of inter-token latency in seconds.",
            ITL_BUCKETS,
        )  # fmt: skip
        self.tpot_old = H(
            "vllm:time_per_output_token_seconds",
            "Histogram of time per output token in seconds.DEPRECATED: Use "
            "vllm:inter_token_latency_seconds instead.",
            ITL_BUCKETS,
        )
        self.req_tpot = H(
            "vllm:request_time_per_output_token_seconds",
            "Histogram of time_per_output_token_seconds per request.", ITL_BUCKETS,
        )  # fmt: skip
        lat = REQUEST_LATENCY_BUCKETS
        self.e2e = H(
            "vllm:e2e_request_latency_seconds", "Histogram of e2e request latency in seconds.", lat
        )
        self.queue = H(
            "vllm:request_queue_time_seconds",
            "Histogram of time spent in WAITING phase for request.", lat,
        )  # fmt: skip
        self.inference = H(
            "vllm:request_inference_time_seconds",
            "Histogram of time spent in RUNNING phase for request.", lat,
        )  # fmt: skip
        self.prefill = H(
            "vllm:request_prefill_time_seconds",
            "Histogram of time spent in PREFILL phase for request.", lat,
        )  # fmt: skip
        self.decode = H(
            "vllm:request_decode_time_seconds",
            "Histogram of time spent in DECODE phase for request.", lat,
        )  # fmt: skip
        self.prompt_tokens_h = H(
            "vllm:request_prompt_tokens", "Number of prefill tokens processed.", tok
        )
        self.generation_tokens_h = H(
            "vllm:request_generation_tokens", "Number of generation tokens processed.", tok
        )
        self.max_gen_h = H(
            "vllm:request_max_num_generation_tokens",
            "Histogram of maximum number of requested generation tokens.", tok,
        )  # fmt: skip
        self.params_n = H(
            "vllm:request_params_n", "Histogram of the n request parameter.",
            REQUEST_PARAMS_N_BUCKETS,
        )  # fmt: skip
        self.params_max_tokens = H(
            "vllm:request_params_max_tokens", "Histogram of the max_tokens request parameter.", tok
        )
        self.prefill_kv_computed = H(
            "vllm:request_prefill_kv_computed_tokens",
            "Histogram of new KV tokens computed during prefill (excluding cached tokens).", tok,
        )  # fmt: skip
        self.req_preemptions = H(
            "vllm:request_num_preemptions",
            "Histogram of number of preemptions per finished request.",
            REQUEST_NUM_PREEMPTIONS_BUCKETS,
        )
        self.iteration_tokens = H(
            "vllm:iteration_tokens_total", "Histogram of number of tokens per engine_step.",
            ITERATION_TOKENS_BUCKETS,
        )  # fmt: skip
        C = Counter
        self.num_preemptions = C(
            "vllm:num_preemptions", "Cumulative number of preemption from the engine."
        )
        self.prompt_tokens = C("vllm:prompt_tokens", "Number of prefill tokens processed.")
        self.prompt_tokens_by_source = C(
            "vllm:prompt_tokens_by_source", "Number of prompt tokens by source.", "source",
            {s: 0.0 for s in PROMPT_SOURCES},
        )  # fmt: skip
        self.prompt_tokens_cached = C(
            "vllm:prompt_tokens_cached", "Number of cached prompt tokens (local + external)."
        )
        self.generation_tokens = C(
            "vllm:generation_tokens", "Number of generation tokens processed."
        )
        self.request_success = C(
            "vllm:request_success", "Count of successfully processed requests.", "finished_reason",
            {r: 0.0 for r in FINISH_REASONS},
        )  # fmt: skip
        self.prefix_cache_queries = C(
            "vllm:prefix_cache_queries",
            "Prefix cache queries, in terms of number of queried tokens.",
        )
        self.prefix_cache_hits = C(
            "vllm:prefix_cache_hits", "Prefix cache hits, in terms of number of cached tokens."
        )
        self.gpu_prefix_cache_queries = C(
            "vllm:gpu_prefix_cache_queries",
            "GPU prefix cache queries, in terms of number of queried tokens.DEPRECATED: Use "
            "vllm:prefix_cache_queries instead.",
        )
        self.gpu_prefix_cache_hits = C(
            "vllm:gpu_prefix_cache_hits",
            "GPU prefix cache hits, in terms of number of cached tokens.DEPRECATED: Use "
            "vllm:prefix_cache_hits instead.",
        )
        for c in (self.num_preemptions, self.prompt_tokens, self.prompt_tokens_cached,
                  self.generation_tokens, self.prefix_cache_queries, self.prefix_cache_hits,
                  self.gpu_prefix_cache_queries, self.gpu_prefix_cache_hits):  # fmt: skip
            c.values[""] = 0.0

    # ---- observations the engine makes -------------------------------------------------------

    def observe_itl(self, gaps: FloatArray) -> None:
        self.itl.observe_many(gaps)
        if "vllm:time_per_output_token_seconds" in self.hidden:
            self.tpot_old.observe_many(gaps)

    def observe_itl_repeated(self, gap: float, n: int) -> None:
        self.itl.observe_repeated(gap, n)
        if "vllm:time_per_output_token_seconds" in self.hidden:
            self.tpot_old.observe_repeated(gap, n)

    def observe_first_token(self, ttft: float, prompt_len: int, cached: int) -> None:
        """A request's first token (buffered like finished requests; Engine inlines this)."""
        self.first_rows.append((ttft, prompt_len, cached))

    def observe_prefix_query(self, queried: int, hits: int) -> None:
        self.prefix_cache_queries.values[""] += queried
        self.prefix_cache_hits.values[""] += hits
        self.gpu_prefix_cache_queries.values[""] += queried
        self.gpu_prefix_cache_hits.values[""] += hits

    def observe_prompt_done(self, prompt_len: int, cached: int) -> None:
        """Counted once per request, when its prefill first completes (not again on recompute)."""
        self.prompt_tokens.values[""] += prompt_len
        by_source = self.prompt_tokens_by_source.values
        by_source["local_compute"] += prompt_len - cached
        by_source["local_cache_hit"] += cached
        self.prompt_tokens_cached.values[""] += cached

    def observe_finished(
        self,
        reason: str,
        e2e: float,
        queue: float,
        prefill: float,
        decode: float,
        inference: float,
        tpot: float,
        prompt_len: int,
        output_len: int,
        max_tokens: int,
        cached: int,
        preemptions: int,
    ) -> None:
        """Everything vLLM records when a request finishes (Engine._finish inlines this)."""
        success = self.request_success.values
        success[reason] = success.get(reason, 0.0) + 1
        self.finished_rows.append(
            (e2e, queue, prefill, decode, inference, tpot, prompt_len, output_len, output_len,
             max_tokens, 1, prompt_len - cached, preemptions)
        )  # fmt: skip
        if len(self.finished_rows) >= 4096:
            self.flush()

    def flush(self) -> None:
        """Bin the buffered per-request observations (one vectorised pass per histogram)."""
        queries = self.prefix_rows
        if queried := sum(q for q, _ in queries):
            self.observe_prefix_query(queried, sum(h for _, h in queries))
        queries.clear()
        firsts = self.first_rows
        if firsts:
            ttft = self.ttft
            total = ttft.sum
            prompt = cached_total = 0
            for value, prompt_len, cached in firsts:
                total += value  # the order and rounding of one observe() at a time
                prompt += prompt_len
                cached_total += cached
            self.observe_prompt_done(prompt, cached_total)  # integer sums: exact
            ttft.add_values(np.fromiter((row[0] for row in firsts), np.float64, len(firsts)))
            ttft.sum = total
            firsts.clear()
        if not self.finished_rows:
            return
        rows = self.finished_rows
        flat = np.fromiter(itertools.chain.from_iterable(rows), np.float64, len(rows) * 13)
        cols = flat.reshape(len(rows), 13).T
        rows.clear()
        hists = (self.e2e, self.queue, self.prefill, self.decode, self.inference, self.req_tpot,
                 self.prompt_tokens_h, self.generation_tokens_h, self.max_gen_h,
                 self.params_max_tokens, self.params_n, self.prefill_kv_computed,
                 self.req_preemptions)  # fmt: skip
        for h, col in zip(hists, cols, strict=True):
            h.observe_many(col)
            h.flush()

    # ---- exposition -------------------------------------------------------------------------

    def _gauges(self) -> list[Gauge]:
        running, waiting, usage = (0, 0, 0.0)
        if self.gauge_provider is not None:
            running, waiting, usage = self.gauge_provider()
        g = [
            Gauge("vllm:num_requests_running", "Number of requests in model execution batches.",
                  None, {"": running}),
            Gauge("vllm:num_requests_waiting", "Number of requests waiting to be processed.",
                  None, {"": waiting}),
            Gauge("vllm:num_requests_waiting_by_reason",
                  "Number of requests waiting, by reason (capacity or deferred).", "reason",
                  {"capacity": waiting, "deferred": 0}),
            Gauge("vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.",
                  None, {"": usage}),
        ]  # fmt: skip
        if "vllm:gpu_cache_usage_perc" in self.hidden:
            g.append(
                Gauge(
                    "vllm:gpu_cache_usage_perc",
                    "GPU KV-cache usage. 1 means 100 percent usage.DEPRECATED: Use "
                    "vllm:kv_cache_usage_perc instead.",
                    None,
                    {"": usage},
                )
            )
        g.append(
            Gauge("vllm:engine_sleep_state",
                  "Engine sleep state; awake = 0 means engine is sleeping; awake = 1 means engine "
                  "is awake; weights_offloaded = 1 means sleep level 1; discard_all = 1 means "
                  "sleep level 2.", "sleep_state", {"awake": 1, "weights_offloaded": 0,
                                                    "discard_all": 0}),
        )  # fmt: skip
        return g

    def histograms(self) -> list[Histogram]:
        self.flush()
        hs = [self.ttft, self.itl, self.req_tpot, self.e2e, self.queue, self.inference,
              self.prefill, self.decode, self.prompt_tokens_h, self.generation_tokens_h,
              self.max_gen_h, self.params_n, self.params_max_tokens, self.prefill_kv_computed,
              self.req_preemptions, self.iteration_tokens]  # fmt: skip
        if "vllm:time_per_output_token_seconds" in self.hidden:
            hs.insert(2, self.tpot_old)
        return hs

    def counters(self) -> list[Counter]:
        cs = [self.num_preemptions, self.prompt_tokens, self.prompt_tokens_by_source,
              self.prompt_tokens_cached, self.generation_tokens, self.request_success,
              self.prefix_cache_queries, self.prefix_cache_hits]  # fmt: skip
        if "vllm:gpu_prefix_cache_queries" in self.hidden:
            cs += [self.gpu_prefix_cache_queries, self.gpu_prefix_cache_hits]
        return cs

    # ---- exposition -------------------------------------------------------------------------

    def families(self) -> Iterator[Metric]:
        """The metric families of one scrape, as vLLM's prometheus_client objects would give."""
        self.flush()
        names = ["model_name", "engine"]
        base = [v for _, v in self.base]
        created = self.created if _CREATED_SERIES else None
        for g in self._gauges():
            extra = [g.extra_label] if g.extra_label else []
            fam = GaugeMetricFamily(g.name, g.help, labels=names + extra)
            for label, v in g.values.items():
                fam.add_metric(base + ([label] if extra else []), v)
            yield fam
        info = GaugeMetricFamily(
            "vllm:cache_config_info",
            "Information of the LLMEngine CacheConfig",
            labels=[k for k, _ in self.cache_config_labels] + ["engine"],
        )
        info.add_metric([v for _, v in self.cache_config_labels] + ["0"], 1.0)
        yield info
        for c in self.counters():
            extra = [c.extra_label] if c.extra_label else []
            cfam = CounterMetricFamily(c.name, c.help, labels=names + extra)
            for label, v in c.values.items():
                cfam.add_metric(base + ([label] if extra else []), v, created=created)
            yield cfam
        for h in self.histograms():
            hfam = HistogramMetricFamily(h.name, h.help, labels=names)
            buckets = [(_go_float(b), float(n)) for b, n in h.bucket_counts()]
            hfam.add_metric(base, buckets, h.sum)
            if created is not None:
                hfam.samples.append(Sample(h.name + "_created", dict(self.base), created))
            yield hfam

    @property
    def registry(self) -> CollectorRegistry:
        """vLLM's registry: the engine's metrics plus prometheus_client's default collectors
        (process, platform and GC, which `prometheus_client.REGISTRY` holds in a real pod)."""
        if self._registry is None:
            self._registry = _default_registry()
            self._registry.register(_Families(self))
        return self._registry

    def exposition(
        self, accept: str = "", accept_encoding: str = "", names: Sequence[str] = ()
    ) -> tuple[bytes, dict[str, str]]:
        """Body and headers of a /metrics answer, negotiated like prometheus_client's ASGI app."""
        return _expose(self.registry, accept, accept_encoding, names)

    def render(self) -> str:
        """The engine's own families in text format 0.0.4 (what `exposition()` gives a client
        that asks for plain text, without the process and GC collectors)."""
        encoder, _ = choose_encoder("text/plain; version=0.0.4")
        return encoder(_Families(self)).decode()


class _Families(Collector):
    def __init__(self, metrics: VllmMetrics) -> None:
        self.metrics = metrics

    def collect(self) -> Iterable[Metric]:
        return self.metrics.families()

    def describe(self) -> Iterable[Metric]:
        # The names the registry indexes (for `name[]` restriction); the families are fixed.
        return list(self.metrics.families())


def _go_float(v: float) -> str:
    """The `le` text prometheus_client's own Histogram writes."""
    text: str = floatToGoString(v)  # type: ignore[no-untyped-call]
    return text


def _default_registry() -> CollectorRegistry:
    reg = CollectorRegistry(auto_describe=False)
    ProcessCollector(registry=reg)
    PlatformCollector(registry=reg)
    GCCollector(registry=reg)
    return reg


def _expose(
    registry: CollectorRegistry, accept: str, accept_encoding: str, names: Sequence[str]
) -> tuple[bytes, dict[str, str]]:
    """prometheus_client's own answer (`exposition._bake_output`, made of its public parts)."""
    encoder, content_type = choose_encoder(accept)
    target: Collector = registry.restricted_registry(list(names)) if names else registry
    body = encoder(target)
    headers = {"Content-Type": content_type}
    if gzip_accepted(accept_encoding):
        body = gzip.compress(body)
        headers["Content-Encoding"] = "gzip"
    return body, headers


def default_registry_exposition(
    accept: str = "", accept_encoding: str = "", names: Sequence[str] = ()
) -> tuple[bytes, dict[str, str]]:
    """/metrics of a vLLM run with --disable-log-stats: prometheus_client's defaults only."""
    return _expose(_default_registry(), accept, accept_encoding, names)


_CREATED_SERIES = os.environ.get("PROMETHEUS_DISABLE_CREATED_SERIES", "").lower() != "true"


def cache_config_labels(fields: Iterable[tuple[str, object]]) -> list[tuple[str, str]]:
    """vLLM's metrics_info(): every CacheConfig field as str(value), so None becomes "None"."""
    return [(k, str(v)) for k, v in fields]
