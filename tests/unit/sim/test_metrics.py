"""The /metrics text is vLLM's: names, labels, buckets, counts that add up, and prometheus_client's
exposition with its content negotiation (`vllm:` in text 0.0.4, `vllm_` when OpenMetrics is
negotiated without `escaping=`, as Prometheus 2.x does)."""

from __future__ import annotations

import dataclasses
import gzip
import math

import numpy as np
import pytest
from prometheus_client.parser import text_string_to_metric_families

from vllm_sim.engine import Engine, StepStats
from vllm_sim.metrics import build_1_2_5_buckets
from vllm_sim.types import EngineConfig, Request, RequestRecord

CFG = EngineConfig(
    model="meta-llama/Llama-3.1-8B-Instruct", max_model_len=4096, served_model_name="llama"
)


def families(text: str) -> dict[str, dict[tuple[str, tuple[tuple[str, str], ...]], float]]:
    out: dict[str, dict[tuple[str, tuple[tuple[str, str], ...]], float]] = {}
    for fam in text_string_to_metric_families(text):
        samples = out.setdefault(fam.name, {})
        for s in fam.samples:
            samples[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def sample(fams, name: str, sample_name: str | None = None, **labels: str) -> float:  # type: ignore[no-untyped-def]
    want = {"model_name": "llama", "engine": "0", **labels}
    for (sname, lab), v in fams[name].items():
        if sname == (sample_name or name) and dict(lab) == want:
            return float(v)
    raise KeyError((name, sample_name, labels))


def run_workload(
    cfg: EngineConfig = CFG, n: int = 120
) -> tuple[Engine, list[RequestRecord], list[StepStats]]:
    rng = np.random.default_rng(5)
    eng = Engine(cfg)
    steps: list[StepStats] = []
    eng.on_step = steps.append
    reqs = [
        Request(f"r{i}", int(rng.integers(50, 2000)), int(rng.integers(1, 400)), i * 0.05,
                "sys" if i % 3 == 0 else None, 256)
        for i in range(n)
    ]  # fmt: skip
    return eng, eng.run(reqs), steps


def test_render_parses_and_keeps_the_colons() -> None:
    eng, _records, _steps = run_workload()
    text = eng.metrics.render()
    assert "vllm_" not in text  # never escaped
    fams = families(text)
    for name in [
        "vllm:num_requests_running", "vllm:num_requests_waiting",
        "vllm:num_requests_waiting_by_reason", "vllm:kv_cache_usage_perc",
        "vllm:engine_sleep_state", "vllm:cache_config_info", "vllm:num_preemptions",
        "vllm:prompt_tokens", "vllm:prompt_tokens_by_source", "vllm:prompt_tokens_cached",
        "vllm:generation_tokens", "vllm:request_success", "vllm:prefix_cache_queries",
        "vllm:prefix_cache_hits", "vllm:time_to_first_token_seconds",
        "vllm:inter_token_latency_seconds", "vllm:request_time_per_output_token_seconds",
        "vllm:e2e_request_latency_seconds", "vllm:request_queue_time_seconds",
        "vllm:request_prefill_time_seconds", "vllm:request_decode_time_seconds",
        "vllm:request_inference_time_seconds", "vllm:request_prompt_tokens",
        "vllm:request_generation_tokens", "vllm:request_max_num_generation_tokens",
        "vllm:request_params_max_tokens", "vllm:request_params_n",
        "vllm:request_prefill_kv_computed_tokens", "vllm:request_num_preemptions",
        "vllm:iteration_tokens_total",
    ]:  # fmt: skip
        assert name in fams, name
    assert "vllm:gpu_cache_usage_perc" not in fams
    assert "# TYPE vllm:prompt_tokens_total counter" in text
    assert "# TYPE vllm:iteration_tokens_total histogram" in text
    # prometheus_client writes labels sorted by name
    assert 'vllm:iteration_tokens_total_bucket{engine="0",le="1.0",model_name="llama"}' in text


def test_counts_match_the_records() -> None:
    eng, records, steps = run_workload()
    fams = families(eng.metrics.render())
    n = len(records)
    for h in ("vllm:e2e_request_latency_seconds", "vllm:time_to_first_token_seconds",
              "vllm:request_queue_time_seconds", "vllm:request_prompt_tokens"):  # fmt: skip
        assert sample(fams, h, h + "_count") == n
    assert sample(
        fams, "vllm:e2e_request_latency_seconds", "vllm:e2e_request_latency_seconds_sum"
    ) == pytest.approx(sum(r.e2e for r in records))
    assert sample(
        fams, "vllm:time_to_first_token_seconds", "vllm:time_to_first_token_seconds_sum"
    ) == pytest.approx(sum(r.ttft or 0 for r in records))
    itl = "vllm:inter_token_latency_seconds"
    assert sample(fams, itl, itl + "_count") == sum(len(r.itl) for r in records)
    assert sample(fams, itl, itl + "_sum") == pytest.approx(sum(sum(r.itl) for r in records))
    gen = sum(r.output_len for r in records)
    assert sample(fams, "vllm:generation_tokens", "vllm:generation_tokens_total") == gen
    prompt = sum(r.prompt_len for r in records)
    cached = sum(r.cached_tokens for r in records)
    assert cached > 0
    assert sample(fams, "vllm:prompt_tokens", "vllm:prompt_tokens_total") == prompt
    assert sample(fams, "vllm:prompt_tokens_cached", "vllm:prompt_tokens_cached_total") == cached
    assert (
        sample(
            fams,
            "vllm:prompt_tokens_by_source",
            "vllm:prompt_tokens_by_source_total",
            source="local_compute",
        )
        == prompt - cached
    )
    assert sample(fams, "vllm:prefix_cache_hits", "vllm:prefix_cache_hits_total") == cached
    assert sample(fams, "vllm:prefix_cache_queries", "vllm:prefix_cache_queries_total") == prompt
    assert (
        sample(fams, "vllm:request_success", "vllm:request_success_total", finished_reason="length")
        == n
    )
    assert (
        sample(fams, "vllm:request_success", "vllm:request_success_total", finished_reason="stop")
        == 0
    )
    it = "vllm:iteration_tokens_total"
    assert sample(fams, it, it + "_count") == len(steps)
    assert sample(fams, it, it + "_sum") == sum(s.scheduled_tokens for s in steps)
    # one bucket checked by hand: TTFTs at or under 0.1 s
    le = sample(
        fams,
        "vllm:time_to_first_token_seconds",
        "vllm:time_to_first_token_seconds_bucket",
        le="0.1",
    )
    assert le == sum(1 for r in records if (r.ttft or 0) <= 0.1)
    assert sample(fams, "vllm:num_requests_running") == 0
    assert sample(fams, "vllm:kv_cache_usage_perc") == 0.0  # idle: cached blocks count as free


def test_buckets_are_cumulative_and_vllms() -> None:
    eng, _, _ = run_workload(n=30)
    fams = families(eng.metrics.render())
    ttft = fams["vllm:time_to_first_token_seconds"]
    bounds = sorted(
        (float(dict(lab)["le"]), v) for (name, lab), v in ttft.items() if name.endswith("_bucket")
    )
    assert [b for b, _ in bounds][:3] == [0.001, 0.005, 0.01] and bounds[-1][0] == math.inf
    assert len(bounds) == 23  # 22 bounds of vLLM buckets.py plus +Inf
    counts = [v for _, v in bounds]
    assert counts == sorted(counts) and counts[-1] == 30
    tok = fams["vllm:request_prompt_tokens"]
    les = sorted(float(dict(lab)["le"]) for (n, lab), _ in tok.items() if n.endswith("_bucket"))
    assert les[:-1] == [1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000]  # vLLM buckets.py
    assert build_1_2_5_buckets(4096) == [1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000]


def test_cache_config_info_carries_the_kv_geometry() -> None:
    eng = Engine(CFG)
    text = eng.metrics.render()
    fams = families(text)
    [(_, labels)] = list(fams["vllm:cache_config_info"])
    lab = dict(labels)
    assert lab["num_gpu_blocks"] == str(eng.kv.num_gpu_blocks)
    assert lab["block_size"] == "16"
    assert lab["gpu_memory_utilization"] == "0.92"
    assert lab["cache_dtype"] == "auto"
    assert lab["enable_prefix_caching"] == "True"
    assert lab["kv_cache_size_tokens"] == str(eng.kv.kv_cache_size_tokens)
    assert lab["num_cpu_blocks"] == "None"
    assert lab["engine"] == "0"
    line = next(x for x in text.splitlines() if x.startswith("vllm:cache_config_info{"))
    order = [kv.split("=")[0] for kv in line[line.index("{") + 1 : line.index("}")].split('",')]
    assert order == sorted(order) and len(order) == len(lab)  # prometheus_client sorts labels


def test_live_gauges_follow_the_engine() -> None:
    eng = Engine(dataclasses.replace(CFG, max_num_seqs=2))
    for i in range(5):
        eng.add_request(Request(f"r{i}", 1000, 100))
    eng.run_until(0.05)
    fams = families(eng.metrics.render())
    assert sample(fams, "vllm:num_requests_running") == 2
    assert sample(fams, "vllm:num_requests_waiting") == 3
    assert sample(fams, "vllm:num_requests_waiting_by_reason", reason="capacity") == 3
    pool = eng.sched.pool
    assert sample(fams, "vllm:kv_cache_usage_perc") == pytest.approx(
        1 - pool.num_free() / (eng.kv.num_gpu_blocks - 1)
    )
    assert sample(fams, "vllm:kv_cache_usage_perc") > 0


@pytest.mark.parametrize(
    ("version", "usage", "tpot"),
    [(None, False, False), ("0.10", True, True), ("0.13", True, True), ("0.14", False, True),
     ("0.17", False, True), ("0.18", False, False), ("0.32", False, False)],
)  # fmt: skip
def test_hidden_metrics_come_back_only_for_versions_that_had_them(
    version: str | None, usage: bool, tpot: bool
) -> None:
    eng = Engine(dataclasses.replace(CFG, show_hidden_metrics_for_version=version))
    eng.run([Request("a", 10, 5), Request("b", 10, 5, 0.001)])
    fams = families(eng.metrics.render())
    assert ("vllm:gpu_cache_usage_perc" in fams) is usage
    assert ("vllm:gpu_prefix_cache_queries" in fams) is usage
    assert ("vllm:time_per_output_token_seconds" in fams) is tpot
    if tpot:
        name = "vllm:time_per_output_token_seconds"
        assert sample(fams, name, name + "_count") == 8


def test_served_model_name_defaults_to_the_model() -> None:
    eng = Engine(dataclasses.replace(CFG, served_model_name=None))
    assert 'model_name="meta-llama/Llama-3.1-8B-Instruct"' in eng.metrics.render()


PROMETHEUS_2 = (
    "application/openmetrics-text;version=1.0.0,application/openmetrics-text;version=0.0.1;"
    "q=0.75,text/plain;version=0.0.4;q=0.5,*/*;q=0.1"
)
PROMETHEUS_3 = (
    "application/openmetrics-text;version=1.0.0;escaping=allow-utf-8,"
    "text/plain;version=1.0.0;escaping=allow-utf-8;q=0.6,text/plain;version=0.0.4;q=0.3"
)


def test_plain_text_keeps_the_colons_and_adds_prometheus_clients_collectors() -> None:
    eng, _, _ = run_workload(n=20)
    body, headers = eng.metrics.exposition("text/plain;version=0.0.4")
    assert headers == {"Content-Type": "text/plain; version=0.0.4; charset=utf-8"}
    text = body.decode()
    fams = families(text)
    assert sample(fams, "vllm:generation_tokens", "vllm:generation_tokens_total") > 0
    assert "vllm:generation_tokens_created" in fams  # prometheus_client's _created series
    assert "vllm:time_to_first_token_seconds_created" in fams
    assert "process_cpu_seconds" in fams and "python_info" in fams
    assert not any(name.startswith("vllm_") for name in fams)


def test_prometheus_2_negotiates_openmetrics_and_gets_escaped_names() -> None:
    eng, _, _ = run_workload(n=20)
    body, headers = eng.metrics.exposition(PROMETHEUS_2)
    assert headers["Content-Type"].startswith("application/openmetrics-text")
    assert "escaping=underscores" in headers["Content-Type"]
    text = body.decode()
    assert text.endswith("# EOF\n")
    samples = [line for line in text.splitlines() if not line.startswith("#")]
    # prometheus_client escapes the sample names (its HELP/TYPE lines keep the colons)
    assert not any(line.startswith("vllm:") for line in samples)
    assert any(line.startswith("vllm_num_requests_running{") for line in samples)
    assert (
        'vllm_request_success_total{engine="0",finished_reason="length",model_name="llama"} 20.0'
        in text
    )


def test_prometheus_3_asks_for_utf8_and_keeps_the_colons() -> None:
    eng, _, _ = run_workload(n=5)
    body, headers = eng.metrics.exposition(PROMETHEUS_3)
    assert headers["Content-Type"].startswith("application/openmetrics-text")
    text = body.decode()
    assert "vllm:num_requests_running{" in text and "vllm_" not in text


def test_gzip_and_name_filter_like_prometheus_clients_app() -> None:
    eng, _, _ = run_workload(n=5)
    body, headers = eng.metrics.exposition(
        "", "gzip, deflate", ["vllm:num_requests_running", "vllm:generation_tokens_total"]
    )
    assert headers["Content-Encoding"] == "gzip"
    text = gzip.decompress(body).decode()
    assert set(families(text)) == {"vllm:num_requests_running", "vllm:generation_tokens"}
