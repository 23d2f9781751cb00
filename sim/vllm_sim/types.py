"""Value types shared by the engine, the server, the load generator and the benchmarks.

They are the simulator's contract: the engine consumes `EngineConfig`, `Reality` and `Request`,
and produces `TokenEvent`s (for streaming) and `RequestRecord`s (for measurement). Times are
virtual seconds of the simulated GPU; a server maps them to wall time with its time scale.
"""

from __future__ import annotations

from dataclasses import dataclass, field


class StartupError(RuntimeError):
    """The engine cannot start with this configuration.

    The message is vLLM's own wording (for example "No available memory for the cache blocks"),
    so that a simulated pod crash-loops with the text a real one would log.
    """


@dataclass(frozen=True)
class EngineConfig:
    """The vLLM flags the simulator models, with vLLM 0.33's defaults.

    `model` is a catalog name (e.g. "meta-llama/Llama-3.1-8B-Instruct") or a path to a Hugging
    Face style config.json; `gpu` is a catalog name (e.g. "H100") or a path to a GPU spec file.
    `None` for the two batching knobs means "vLLM's per-GPU default" (vLLM arg_utils.py).
    """

    model: str
    gpu: str = "H100"
    tensor_parallel_size: int = 1
    max_num_seqs: int | None = None
    max_num_batched_tokens: int | None = None
    gpu_memory_utilization: float = 0.92
    max_model_len: int | None = None
    block_size: int = 16
    enable_prefix_caching: bool = True
    enable_chunked_prefill: bool = True
    kv_cache_dtype: str = "auto"
    # vLLM's --quantization: None reads the checkpoint's own quantization_config; "fp8"
    # quantizes an unquantized checkpoint at load time (W8A8 FP8, dynamic activation scales).
    quantization: str | None = None
    long_prefill_token_threshold: int = 0
    served_model_name: str | None = None
    # vLLM's --show-hidden-metrics-for-version: brings back names deprecated in that version.
    show_hidden_metrics_for_version: str | None = None
    # vLLM's --num-gpu-blocks-override: fixes the KV block count after profiling (tests use it to
    # get a small cache without a small GPU).
    num_gpu_blocks_override: int | None = None
    # vLLM's --async-scheduling (on by default since 0.14): step N+1 is scheduled while step N
    # runs, so a request that arrives during a busy step waits one step more.
    async_scheduling: bool = True


@dataclass(frozen=True)
class Reality:
    """Ways the simulated deployment differs from the catalog, hidden from a tuner under test.

    All off by default. They exist so a tuner can be tested against a ground truth it cannot
    read: efficiency off the catalog, per-request CPU cost, noise, and the run-time OOM hazard
    that makes high gpu_memory_utilization dangerous only under large token budgets.
    """

    bandwidth_efficiency: float = 1.0  # multiplies the catalog's achieved memory bandwidth
    compute_efficiency: float = 1.0  # multiplies the catalog's achieved compute (MFU)
    per_request_overhead_s: float = 0.0  # CPU time added to the step that admits a request
    step_jitter: float = 0.0  # relative std-dev of multiplicative log-normal step-time noise
    # Run-time OOM: with gpu_memory_utilization above `oom_above_utilization` and a token budget
    # of at least `oom_min_batched_tokens`, the engine dies (raises EngineCrashed) at a random
    # time with this mean (virtual seconds) after start.
    oom_above_utilization: float | None = None
    oom_min_batched_tokens: int = 0
    oom_mean_time_s: float = 300.0


class EngineCrashed(RuntimeError):
    """The engine died at run time (the simulated CUDA OOM of `Reality`)."""


@dataclass(frozen=True)
class Request:
    """One generation request as the engine sees it (already tokenized).

    Prompts that share a prefix carry the same `prefix_id`; the first `prefix_len` tokens are
    then identical across them, which is what prefix caching can reuse (in whole blocks).
    """

    request_id: str
    prompt_len: int
    max_tokens: int
    arrival_time: float = 0.0
    prefix_id: str | None = None
    prefix_len: int = 0


@dataclass(frozen=True)
class TokenEvent:
    """A token produced for a request at virtual time `time` (index 0 is the first token)."""

    request_id: str
    index: int
    time: float
    finished: bool = False
    finish_reason: str | None = None  # "length", "abort", "error" when finished


@dataclass(slots=True)
class RequestRecord:
    """What happened to one finished request, in virtual seconds (engine-side timings)."""

    request_id: str
    arrival_time: float
    prompt_len: int
    output_len: int
    max_tokens: int
    first_scheduled_time: float | None
    first_token_time: float | None
    finish_time: float
    finish_reason: str
    cached_tokens: int = 0
    num_preemptions: int = 0
    # Gaps between consecutive tokens (seconds); empty when fewer than two tokens.
    itl: list[float] = field(default_factory=list)

    @property
    def ttft(self) -> float | None:
        return None if self.first_token_time is None else self.first_token_time - self.arrival_time

    @property
    def e2e(self) -> float:
        return self.finish_time - self.arrival_time

    @property
    def queue_time(self) -> float | None:
        if self.first_scheduled_time is None:
            return None
        return self.first_scheduled_time - self.arrival_time

    @property
    def tpot(self) -> float:
        """vLLM's request_time_per_output_token: decode time over (tokens - 1), 0 if <= 1."""
        if self.output_len <= 1 or self.first_token_time is None:
            return 0.0
        return (self.finish_time - self.first_token_time) / (self.output_len - 1)
