"""vLLM's command line as vllm-sim reads it (vLLM arg_utils.py)."""

from __future__ import annotations

import argparse
import io

import pytest

from vllm_sim.flags import ServeOptions, build_serve_parser, human_readable_int, parse_serve_args
from vllm_sim.types import EngineConfig, Reality

MODEL = "meta-llama/Llama-3.1-8B-Instruct"


def parse(*args: str, env: dict[str, str] | None = None) -> tuple[ServeOptions, str]:
    err = io.StringIO()
    options = parse_serve_args([MODEL, *args], env=env or {}, stderr=err)
    return options, err.getvalue()


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("8192", 8192),
        ("8k", 8 * 1000),
        ("8K", 8 * 1024),
        ("1.5k", 1500),
        ("2m", 2 * 10**6),
        ("2M", 2 * 2**20),
        ("1G", 2**30),
        (" 32K ", 32 * 1024),
    ],
)
def test_human_readable_ints(text: str, expected: int) -> None:
    assert human_readable_int(text) == expected


@pytest.mark.parametrize("text", ["1.5K", "eight", "8x", ""])
def test_bad_human_readable_ints_are_rejected(text: str) -> None:
    with pytest.raises(argparse.ArgumentTypeError):
        human_readable_int(text)


def test_modelled_flags_reach_the_engine_config() -> None:
    options, warning = parse(
        "--max-num-seqs", "64",
        "--max-num-batched-tokens", "8K",
        "--gpu-memory-utilization", "0.85",
        "-tp", "2",
        "--max-model-len", "32k",
        "--kv-cache-dtype", "fp8",
        "--no-enable-prefix-caching",
        "--block-size", "32",
        "--long-prefill-token-threshold", "1k",
        "--served-model-name", "llama", "other",
        "--show-hidden-metrics-for-version", "0.32",
        "--port", "9001",
        "--host", "127.0.0.1",
    )  # fmt: skip
    assert warning == ""
    config = options.config
    assert config == EngineConfig(
        model=MODEL,
        max_num_seqs=64,
        max_num_batched_tokens=8192,
        gpu_memory_utilization=0.85,
        tensor_parallel_size=2,
        max_model_len=32000,
        kv_cache_dtype="fp8",
        enable_prefix_caching=False,
        block_size=32,
        long_prefill_token_threshold=1000,
        served_model_name="llama",
        show_hidden_metrics_for_version="0.32",
    )
    assert options.port == 9001
    assert options.host == "127.0.0.1"


def test_defaults_are_the_engine_config_defaults() -> None:
    options, _ = parse()
    assert options.config == EngineConfig(model=MODEL)
    assert options.reality == Reality()
    assert options.port == 8000


def test_model_may_be_given_as_a_flag() -> None:
    options = parse_serve_args(["--model", MODEL, "--max-num-seqs", "8"], env={})
    assert options.config.model == MODEL


@pytest.mark.parametrize("value", ["auto", "-1"])
def test_max_model_len_auto_means_the_model_default(value: str) -> None:
    options, _ = parse("--max-model-len", value)
    assert options.config.max_model_len is None


def test_unmodelled_and_unknown_flags_are_accepted_with_a_warning() -> None:
    options, warning = parse(
        "--enforce-eager",
        "--trust-remote-code",
        "--download-dir", "/models",
        "-O3",
        "--no-async-scheduling",
        "--some-future-flag=1",
        "--another-unknown",
        "--max-num-seqs", "32",
    )  # fmt: skip
    # The value of a known-but-ignored flag must not be mistaken for the model.
    assert options.config.model == MODEL
    assert options.config.max_num_seqs == 32
    assert "WARNING" in warning
    for flag in (
        "--enforce-eager",
        "--trust-remote-code",
        "--download-dir /models",
        "--optimization-level 3",
        "--no-async-scheduling",
        "--some-future-flag=1",
        "--another-unknown",
    ):
        assert flag in warning


def test_quantization_is_modelled() -> None:
    assert parse()[0].config.quantization is None
    options, warning = parse("--quantization", "fp8")
    assert options.config.quantization == "fp8" and "quantization" not in warning
    assert parse("-q", "fp8")[0].config.quantization == "fp8"


def test_shutdown_timeout_is_modelled_with_vllms_default_of_zero() -> None:
    assert parse()[0].shutdown_timeout == 0
    options, warning = parse("--shutdown-timeout", "30")
    assert options.shutdown_timeout == 30
    assert "shutdown" not in warning


@pytest.mark.parametrize(
    "bad",
    [
        ["--gpu-memory-utilization", "1.5"],
        ["--max-num-seqs", "x"],
        ["--shutdown-timeout", "-1"],
        ["--shutdown-timeout", "soon"],
    ],
)
def test_invalid_values_fail_like_argparse(bad: list[str]) -> None:
    with pytest.raises(SystemExit):
        parse_serve_args([MODEL, *bad], env={}, stderr=io.StringIO())


def test_sim_flags_come_from_the_environment_and_the_command_line_wins() -> None:
    env = {
        "VLLM_SIM_GPU": "H200",
        "VLLM_SIM_TIME_SCALE": "5",
        "VLLM_SIM_LOAD_TIME": "0",
        "VLLM_SIM_STEP_JITTER": "0.1",
        "VLLM_SIM_OOM_ABOVE_UTILIZATION": "0.9",
        "VLLM_SIM_OOM_MIN_BATCHED_TOKENS": "16k",
    }
    options, _ = parse("--sim-time-scale", "2", env=env)
    assert options.config.gpu == "H200"
    assert options.time_scale == 2.0
    assert options.load_time == 0.0
    assert options.reality.step_jitter == 0.1
    assert options.reality.oom_above_utilization == 0.9
    assert options.reality.oom_min_batched_tokens == 16_000


def test_a_bad_environment_value_is_an_error() -> None:
    with pytest.raises(SystemExit):
        parse_serve_args([MODEL], env={"VLLM_SIM_TIME_SCALE": "fast"}, stderr=io.StringIO())


def test_sim_flags_build_the_reality() -> None:
    options, _ = parse(
        "--sim-bandwidth-efficiency", "0.8",
        "--sim-compute-efficiency", "0.6",
        "--sim-request-overhead", "0.002",
        "--sim-oom-mean-time", "60",
        "--sim-seed", "7",
    )  # fmt: skip
    assert options.reality == Reality(
        bandwidth_efficiency=0.8,
        compute_efficiency=0.6,
        per_request_overhead_s=0.002,
        oom_mean_time_s=60.0,
    )
    assert options.seed == 7


def test_help_documents_the_time_scale_and_environment() -> None:
    text = build_serve_parser(env={}).format_help()
    assert "rate()" in text
    assert "VLLM_SIM_TIME_SCALE" in text
