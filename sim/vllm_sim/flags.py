"""vLLM's command line, as far as the simulator models it.

A Deployment rendered for real vLLM must start vllm-sim unchanged, so the parser accepts vLLM
0.33's spelling of every flag (human-readable integers, `--no-X` booleans, `-tp`, `-O3`) and
accepts flags it does not model with a warning instead of failing. Simulator-only settings are
`--sim-*` flags, each also readable from the environment as `VLLM_SIM_<NAME>` (e.g.
`VLLM_SIM_GPU`, `VLLM_SIM_TIME_SCALE`) so that a pod template can set them without touching the
vLLM arguments the operator renders; the command line wins over the environment.
"""

from __future__ import annotations

import argparse
import os
import re
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import TextIO

from vllm_sim.types import EngineConfig, Reality

_DECIMAL_SUFFIX = {"k": 10**3, "m": 10**6, "g": 10**9, "t": 10**12}
_BINARY_SUFFIX = {"K": 2**10, "M": 2**20, "G": 2**30, "T": 2**40}


def human_readable_int(value: str) -> int:
    """vLLM's integer syntax: lower-case suffixes are decimal (8k = 8000), upper-case binary
    (8K = 8192) and take no decimals (vllm/engine/arg_utils.py `human_readable_int`)."""
    text = value.strip()
    match = re.fullmatch(r"(\d+(?:\.\d+)?)([kKmMgGtT])", text)
    if match:
        number, suffix = match.groups()
        if suffix in _DECIMAL_SUFFIX:
            return int(float(number) * _DECIMAL_SUFFIX[suffix])
        if "." in number:
            raise argparse.ArgumentTypeError(
                f"Decimals are not allowed with binary suffixes like {suffix}. "
                f"Did you mean to use {number}{suffix.lower()} instead?"
            )
        return int(number) * _BINARY_SUFFIX[suffix]
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"invalid integer: {value!r}") from None


def max_model_len_value(value: str) -> int | None:
    """--max-model-len: a human-readable int, or -1/auto (auto-fit, approximated as the model's
    own maximum: the simulator does not shrink the context to fit the KV cache)."""
    if value.strip().lower() in ("auto", "-1"):
        return None
    return human_readable_int(value)


def _fraction(value: str) -> float:
    number = float(value)
    if not 0.0 < number <= 1.0:
        raise argparse.ArgumentTypeError(f"must be in (0, 1], got {value}")
    return number


def _non_negative_int(value: str) -> int:
    number = human_readable_int(value)
    if number < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {value}")
    return number


def _positive_float(value: str) -> float:
    number = float(value)
    if number <= 0.0:
        raise argparse.ArgumentTypeError(f"must be > 0, got {value}")
    return number


# vLLM flags the simulator accepts and ignores (they change nothing it models). Listing the
# common ones lets a value-taking flag keep its value instead of the value being mistaken
# for the model; any other unknown flag is accepted too, with the same warning.
_IGNORED_VALUE_FLAGS = (
    "--download-dir",
    "--swap-space",
    "--tokenizer",
    "--tokenizer-mode",
    "--revision",
    "--code-revision",
    "--tokenizer-revision",
    "--chat-template",
    "--tool-call-parser",
    "--reasoning-parser",
    "--load-format",
    "--seed",
    "--cpu-offload-gb",
    "--max-logprobs",
    "--api-key",
    "--uvicorn-log-level",
    "--config",
    "--hf-overrides",
    "--generation-config",
    "--performance-mode",
    "--scheduling-policy",
    "--max-num-scheduled-tokens",
    "--num-gpu-blocks-override",
    "--kv-cache-memory-bytes",
    "--stream-interval",
    "--watermark",
    "--max-cudagraph-capture-size",
    "--compilation-config",
    "--speculative-config",
    "--pipeline-parallel-size",
    "--data-parallel-size",
    "--distributed-executor-backend",
    "--max-num-queued-reqs",
    "--max-num-queued-tokens",
    "--prefix-caching-hash-algo",
    "--custom-histogram-buckets",
    "--root-path",
    "--allowed-origins",
    "--lora-modules",
    "--max-lora-rank",
    "--max-loras",
)
_IGNORED_VALUE_SHORT = {"-pp": "--pipeline-parallel-size", "-dp": "--data-parallel-size"}
_IGNORED_SWITCHES = (
    "--enforce-eager",
    "--trust-remote-code",
    "--async-scheduling",
    "--disable-log-requests",
    "--enable-log-requests",
    "--disable-frontend-multiprocessing",
    "--enable-auto-tool-choice",
    "--disable-custom-all-reduce",
    "--enable-lora",
    "--enable-expert-parallel",
    "--enable-mfu-metrics",
    "--kv-cache-metrics",
    "--disable-fastapi-docs",
    "--enable-prompt-tokens-details",
    "--enable-force-include-usage",
    "--long-prefill-token-threshold-adaptive",
    "--scheduler-reserve-full-isl",
    "--disable-uvicorn-access-log",
    "--enable-server-load-tracking",
)

# The simulator's own settings: (flag suffix, type, default, help).
_SIM_FLAGS: tuple[tuple[str, type | object, object, str], ...] = (
    ("gpu", str, "H100", "GPU catalog name or path to a GPU spec file"),
    (
        "time-scale",
        _positive_float,
        1.0,
        "virtual seconds per wall second (2.0 = the simulated GPU runs twice as fast as the clock)",
    ),
    (
        "load-time",
        float,
        0.5,
        "wall seconds of simulated model loading before the port accepts connections",
    ),
    ("seed", int, 0, "random seed of the simulation (step jitter, OOM time)"),
    ("bandwidth-efficiency", _positive_float, 1.0, "multiplies the catalog's memory bandwidth"),
    ("compute-efficiency", _positive_float, 1.0, "multiplies the catalog's compute (MFU)"),
    ("request-overhead", float, 0.0, "CPU seconds added to the step that admits a request"),
    ("step-jitter", float, 0.0, "relative std-dev of log-normal step-time noise"),
    (
        "oom-above-utilization",
        float,
        None,
        "run-time CUDA OOM hazard when --gpu-memory-utilization is above this",
    ),
    (
        "oom-min-batched-tokens",
        human_readable_int,
        0,
        "... and --max-num-batched-tokens is at least this",
    ),
    ("oom-mean-time", float, 300.0, "mean virtual seconds until the OOM strikes"),
    (
        "crash-exit-code",
        int,
        1,
        "exit status after a simulated run-time OOM (137 imitates a SIGKILL)",
    ),
)


def sim_env_name(suffix: str) -> str:
    """`time-scale` -> `VLLM_SIM_TIME_SCALE`."""
    return "VLLM_SIM_" + suffix.upper().replace("-", "_")


def add_engine_arguments(
    parser: argparse.ArgumentParser, env: Mapping[str, str], *, keep: Sequence[str] = ()
) -> None:
    """The vLLM engine flags the simulator models, the ignored ones, and the --sim-* flags.

    `keep` names ignored vLLM flags to leave out, so a command can give them its own meaning
    (`vllm-sim run --seed` seeds the workload)."""
    parser.add_argument("model", nargs="?", help="model catalog name or path to a config.json")
    parser.add_argument("--model", dest="model_flag", default=None, help=argparse.SUPPRESS)
    group = parser.add_argument_group("vLLM engine flags (modelled)")
    group.add_argument("--max-num-seqs", type=human_readable_int, default=None)
    group.add_argument("--max-num-batched-tokens", type=human_readable_int, default=None)
    group.add_argument(
        "--gpu-memory-utilization", "--device-memory-utilization", type=_fraction, default=0.92
    )
    group.add_argument("--tensor-parallel-size", "-tp", type=int, default=1)
    group.add_argument("--max-model-len", type=max_model_len_value, default=None)
    group.add_argument("--kv-cache-dtype", default="auto")
    group.add_argument("--quantization", "-q", default=None)
    group.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction)
    group.add_argument("--enable-chunked-prefill", action=argparse.BooleanOptionalAction)
    group.add_argument("--block-size", type=int, default=None)
    group.add_argument("--long-prefill-token-threshold", type=human_readable_int, default=0)
    group.add_argument("--dtype", default="auto")
    group.add_argument("--served-model-name", nargs="+", default=None)
    group.add_argument("--show-hidden-metrics-for-version", default=None)
    group.add_argument("--disable-log-stats", action="store_true")

    ignored = parser.add_argument_group("vLLM flags accepted and ignored (with a warning)")
    for flag in _IGNORED_VALUE_FLAGS:
        if flag in keep:
            continue
        shorts = [s for s, long in _IGNORED_VALUE_SHORT.items() if long == flag]
        ignored.add_argument(
            flag, *shorts, dest=f"ignored_{flag[2:]}", default=None, help=argparse.SUPPRESS
        )
    ignored.add_argument(
        "--optimization-level", "-O", dest="ignored_optimization-level", help=argparse.SUPPRESS
    )
    for flag in _IGNORED_SWITCHES:
        ignored.add_argument(
            flag,
            dest=f"ignored_{flag[2:]}",
            action=argparse.BooleanOptionalAction,
            default=None,
            help=argparse.SUPPRESS,
        )

    sim = parser.add_argument_group(
        "simulator flags", "each can also be set in the environment as VLLM_SIM_<NAME>"
    )
    for suffix, kind, default, text in _SIM_FLAGS:
        env_name = sim_env_name(suffix)
        # argparse converts string defaults with `type`, so the environment gets validated too.
        env_value = env.get(env_name)
        sim.add_argument(
            f"--sim-{suffix}",
            type=kind,  # type: ignore[arg-type]
            default=env_value if env_value is not None else default,
            help=f"{text} [{env_name}; default {default}]",
        )


def add_server_arguments(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("server flags")
    group.add_argument("--host", default=None, help="address to listen on (default: all)")
    group.add_argument("--port", type=int, default=8000)
    group.add_argument(
        "--shutdown-timeout",
        type=_non_negative_int,
        default=0,
        help="seconds to finish in-flight requests after SIGTERM; 0 aborts them at once "
        "(vLLM's default), N > 0 refuses new requests and drains for up to N seconds",
    )


def ignored_flags(namespace: argparse.Namespace, unknown: Sequence[str]) -> list[str]:
    """The accepted-but-not-modelled flags that were given, for the warning."""
    given = []
    for key, value in vars(namespace).items():
        if key.startswith("ignored_") and value is not None:
            name = key[len("ignored_") :]
            if value is True:
                given.append(f"--{name}")
            elif value is False:
                given.append(f"--no-{name}")
            else:
                given.append(f"--{name} {value}")
    if namespace.dtype not in ("auto", "bfloat16", "float16", "half"):
        given.append(f"--dtype {namespace.dtype}")
    return given + list(unknown)


def engine_config_from(namespace: argparse.Namespace) -> EngineConfig:
    model = namespace.model_flag or namespace.model
    if not model:
        raise SystemExit("error: a model is required (vllm-sim serve MODEL ...)")
    kwargs: dict[str, object] = {}
    if namespace.enable_prefix_caching is not None:
        kwargs["enable_prefix_caching"] = namespace.enable_prefix_caching
    if namespace.enable_chunked_prefill is not None:
        kwargs["enable_chunked_prefill"] = namespace.enable_chunked_prefill
    if namespace.block_size is not None:
        kwargs["block_size"] = namespace.block_size
    served = namespace.served_model_name[0] if namespace.served_model_name else None
    return EngineConfig(
        model=model,
        gpu=namespace.sim_gpu,
        tensor_parallel_size=namespace.tensor_parallel_size,
        max_num_seqs=namespace.max_num_seqs,
        max_num_batched_tokens=namespace.max_num_batched_tokens,
        gpu_memory_utilization=namespace.gpu_memory_utilization,
        max_model_len=namespace.max_model_len,
        kv_cache_dtype=namespace.kv_cache_dtype,
        quantization=namespace.quantization,
        long_prefill_token_threshold=namespace.long_prefill_token_threshold,
        served_model_name=served,
        show_hidden_metrics_for_version=namespace.show_hidden_metrics_for_version,
        **kwargs,  # type: ignore[arg-type]
    )


def reality_from(namespace: argparse.Namespace) -> Reality:
    return Reality(
        bandwidth_efficiency=namespace.sim_bandwidth_efficiency,
        compute_efficiency=namespace.sim_compute_efficiency,
        per_request_overhead_s=namespace.sim_request_overhead,
        step_jitter=namespace.sim_step_jitter,
        oom_above_utilization=namespace.sim_oom_above_utilization,
        oom_min_batched_tokens=namespace.sim_oom_min_batched_tokens,
        oom_mean_time_s=namespace.sim_oom_mean_time,
    )


@dataclass(frozen=True)
class ServeOptions:
    """Everything `vllm-sim serve` needs, parsed from the command line and environment."""

    config: EngineConfig
    reality: Reality
    host: str | None = None
    port: int = 8000
    time_scale: float = 1.0
    load_time: float = 0.5
    seed: int = 0
    crash_exit_code: int = 1
    disable_log_stats: bool = False
    # vLLM's --shutdown-timeout, in wall seconds (see SimServer.drain).
    shutdown_timeout: int = 0
    ignored: list[str] = field(default_factory=list)


SERVE_DESCRIPTION = """\
Serve a simulated vLLM: the OpenAI API (/v1/completions, /v1/chat/completions, /v1/models),
/metrics with vLLM's metric names, /health, /version and /load.

Time scale: the simulated GPU runs --sim-time-scale virtual seconds per wall second. Latency
histograms and gauges are in virtual seconds (what the simulated GPU would show), while counters
count events, so a Prometheus rate() per wall second equals the virtual rate x time scale.
"""


def build_serve_parser(env: Mapping[str, str] | None = None) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="vllm-sim serve",
        description=SERVE_DESCRIPTION,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_engine_arguments(parser, os.environ if env is None else env)
    add_server_arguments(parser)
    return parser


def warn_ignored(ignored: Sequence[str], stream: TextIO | None = None) -> None:
    if ignored:
        print(
            "WARNING vllm-sim: accepted but not simulated: " + " ".join(ignored),
            file=stream or sys.stderr,
        )


def parse_serve_args(
    argv: Sequence[str],
    env: Mapping[str, str] | None = None,
    stderr: TextIO | None = None,
) -> ServeOptions:
    """Parse `vllm-sim serve` arguments; flags that are not modelled are warned about on stderr."""
    parser = build_serve_parser(env)
    namespace, unknown = parser.parse_known_args(list(argv))
    ignored = ignored_flags(namespace, unknown)
    warn_ignored(ignored, stderr)
    return ServeOptions(
        config=engine_config_from(namespace),
        reality=reality_from(namespace),
        host=namespace.host,
        port=namespace.port,
        time_scale=namespace.sim_time_scale,
        load_time=namespace.sim_load_time,
        seed=namespace.sim_seed,
        crash_exit_code=namespace.sim_crash_exit_code,
        disable_log_stats=namespace.disable_log_stats,
        shutdown_timeout=namespace.shutdown_timeout,
        ignored=ignored,
    )
