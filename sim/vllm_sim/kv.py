"""Knob resolution and KV-cache sizing at engine start, as vLLM 0.33 does them.

A tuner moving gpu_memory_utilization, max_num_batched_tokens and max_num_seqs changes the KV
capacity three ways at once (budget share, activation peak, CUDA-graph memory); modelling all three
is what makes the simulated capacity respond to the knobs the way a real pod's does.
References: vLLM 0.33 arg_utils.py (defaults), gpu_worker.py and kv_cache_planning.py (sizing,
start-up failures), config/vllm.py (capture sizes).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

from vllm_sim.catalog import GiB, GpuSpec, ModelSpec, ceil_div, load_model, quantization_from_flag
from vllm_sim.types import EngineConfig, StartupError

MiB = 1 << 20
_CONSERVING_MEMORY = (
    "See https://docs.vllm.ai/en/latest/configuration/conserving_memory/ for more details."
)


@dataclass(frozen=True)
class MemoryConstants:
    """Memory vLLM's profiler counts that no config field states; one place to re-fit them.

    Fitted on the KV block counts logged by the inference-sim project's real runs (H100,
    util 0.90, budget 2048, 128 seqs): Llama-2-7B TP1 7462, CodeLlama-34B TP2 26602, Mixtral TP2
    27510, Llama-2-70B TP4 31356 blocks. TP>1 leaves ~0.45 GiB more on each rank (NCCL and the
    custom all-reduce buffers).
    """

    cuda_context_bytes: int = 512 * MiB  # taken before vLLM's memory snapshot (not in the budget)
    nontorch_bytes: int = 200 * MiB  # cuBLAS workspaces, allocator slack inside the budget
    nontorch_tp_extra_bytes: int = 460 * MiB
    cudagraph_bytes_per_size_layer: int = 256 * 1024  # graph pools: per capture size, per layer
    sampler_logit_copies: int = 2  # fp32 logits and probabilities of the dummy sampler run


MEMORY = MemoryConstants()


@dataclass(frozen=True)
class KVCacheInfo:
    """The outcome of vLLM's start-up profiling, per GPU unless said otherwise."""

    num_gpu_blocks: int
    block_size: int
    kv_bytes_per_token: int
    kv_dtype_bytes: int
    kv_cache_size_tokens: int
    kv_cache_memory_bytes: int
    max_concurrency: float
    requested_memory_bytes: int
    weights_bytes: int
    activation_bytes: int
    cudagraph_bytes: int
    nontorch_bytes: int
    num_cudagraph_sizes: int

    @property
    def usable_blocks(self) -> int:
        """One block is the permanent null block (vLLM kv_cache_planning.py)."""
        return self.num_gpu_blocks - 1


def engine_model(cfg: EngineConfig) -> ModelSpec:
    """The model as the engine loads it: its config.json, quantized at load time when
    `--quantization fp8` asks for it (vLLM refuses a method that contradicts the checkpoint)."""
    model = load_model(cfg.model)
    flag = cfg.quantization
    if not flag:
        return model
    if model.quant.quantized:
        if flag.lower() not in model.quant.method:
            raise StartupError(
                f"Quantization method specified in the model config ({model.quant.method}) does "
                f"not match the quantization method specified in the `quantization` argument "
                f"({flag})."
            )
        return model
    try:
        return dataclasses.replace(model, quant=quantization_from_flag(flag))
    except ValueError as exc:
        raise StartupError(str(exc)) from None


def kv_dtype_bytes(kv_cache_dtype: str, model: ModelSpec) -> int:
    if kv_cache_dtype == "auto":
        return model.dtype_bytes
    if kv_cache_dtype.startswith("fp8") or kv_cache_dtype in ("int8_per_token_head",):
        return 1
    if kv_cache_dtype in ("float16", "bfloat16", "half"):
        return 2
    if kv_cache_dtype in ("float32", "float"):
        return 4
    raise StartupError(f"Unknown kv cache dtype: {kv_cache_dtype}")


def default_batch_knobs(gpu: GpuSpec) -> tuple[int, int]:
    """(max_num_batched_tokens, max_num_seqs) of `vllm serve` (API-server tier, arg_utils.py)."""
    mem = gpu.memory_bytes
    if mem >= 160 * GiB:
        return 16384, 1024
    if mem >= 70 * GiB and "a100" not in gpu.device_name.lower():
        return 8192, 1024
    return 2048, 256


def cudagraph_capture_sizes(
    max_num_seqs: int, max_num_batched_tokens: int, sm100: bool
) -> list[int]:
    """vLLM's default capture sizes (config/vllm.py): 1,2,4, steps of 8, then 16, up to the max."""
    cap = min(max_num_seqs * 2, 1024 if sm100 else 512)
    cap = min(cap, max_num_batched_tokens)
    sizes = {s for s in (1, 2, 4) if s <= cap}
    sizes.update(range(8, min(cap, 248) + 1, 8))
    sizes.update(range(256, cap + 1, 16))
    for extra in (max_num_batched_tokens, max_num_seqs):
        if extra <= cap:
            sizes.add(extra)
    return sorted(sizes)


def resolve_config(cfg: EngineConfig, model: ModelSpec, gpu: GpuSpec) -> EngineConfig:
    """Fill the None knobs like EngineArgs does, then validate like SchedulerConfig does."""
    derived_len = model.max_position_embeddings
    mml = cfg.max_model_len if cfg.max_model_len is not None else derived_len
    if mml > derived_len:
        raise StartupError(
            f"User-specified max_model_len ({mml}) is greater than the derived max_model_len "
            f"(max_position_embeddings={derived_len} or model_max_length=None in model's "
            "config.json). To allow overriding this maximum, set the env var "
            "VLLM_ALLOW_LONG_MAX_MODEL_LEN=1. VLLM_ALLOW_LONG_MAX_MODEL_LEN must be used with "
            "extreme caution."
        )
    if not 0.0 < cfg.gpu_memory_utilization <= 1.0:
        raise StartupError(
            f"gpu_memory_utilization must be in (0, 1], got {cfg.gpu_memory_utilization}"
        )
    if cfg.tensor_parallel_size < 1 or model.num_attention_heads % cfg.tensor_parallel_size:
        raise StartupError(
            f"Total number of attention heads ({model.num_attention_heads}) must be divisible "
            f"by tensor parallel size ({cfg.tensor_parallel_size})."
        )
    default_mnbt, default_mns = default_batch_knobs(gpu)
    mns = cfg.max_num_seqs if cfg.max_num_seqs is not None else default_mns
    mnbt = cfg.max_num_batched_tokens
    if mnbt is None:
        mnbt = default_mnbt
        if not cfg.enable_chunked_prefill:
            mnbt = max(mml, mnbt)  # post-processing step 3
        mnbt = min(mns * mml, mnbt)  # step 5
    if cfg.max_num_seqs is None:
        mns = min(mns, mnbt)  # step 6
    if not cfg.enable_chunked_prefill and mnbt < mml:
        raise StartupError(
            f"max_num_batched_tokens ({mnbt}) is smaller than max_model_len ({mml}). This "
            "effectively limits the maximum sequence length to max_num_batched_tokens and makes "
            "vLLM reject longer sequences. Please increase max_num_batched_tokens or decrease "
            "max_model_len."
        )
    if mnbt < mns:
        raise StartupError(
            f"max_num_batched_tokens ({mnbt}) must be greater than or equal to max_num_seqs "
            f"({mns})."
        )
    if cfg.long_prefill_token_threshold > mml:
        raise StartupError(
            f"long_prefill_token_threshold ({cfg.long_prefill_token_threshold}) cannot be greater "
            f"than the max_model_len ({mml})."
        )
    return dataclasses.replace(
        cfg, max_num_seqs=mns, max_num_batched_tokens=mnbt, max_model_len=mml
    )


def activation_peak_bytes(model: ModelSpec, tp: int, mnbt: int, mns: int) -> int:
    """Transient peak of the profile run: the MLP of `mnbt` tokens plus the dummy sampler."""
    inter = model.intermediate_size * model.num_experts_per_tok / tp
    per_token = model.dtype_bytes * (3 * inter + 4 * model.hidden_size)
    sampler = mns * model.vocab_size * 4 * MEMORY.sampler_logit_copies
    return int(mnbt * per_token + sampler)


def kv_cache_info(cfg: EngineConfig, model: ModelSpec, gpu: GpuSpec) -> KVCacheInfo:
    """Size the KV cache of a resolved config, or raise StartupError with vLLM's message."""
    assert cfg.max_num_seqs is not None and cfg.max_num_batched_tokens is not None
    assert cfg.max_model_len is not None
    tp = cfg.tensor_parallel_size
    total = gpu.memory_bytes
    free_at_snapshot = total - MEMORY.cuda_context_bytes
    requested = math.ceil(total * cfg.gpu_memory_utilization)
    if free_at_snapshot < requested:
        raise StartupError(
            f"Free memory on device cuda:0 ({free_at_snapshot / GiB:.2f}/{total / GiB:.2f} GiB) on "
            "startup is less than desired GPU memory utilization "
            f"({cfg.gpu_memory_utilization}, {requested / GiB:.2f} GiB). Decrease GPU memory "
            "utilization or reduce GPU memory used by other processes."
        )
    weights = model.weights_bytes // tp
    if weights > free_at_snapshot:
        raise StartupError(
            "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate "
            f"{weights / GiB:.2f} GiB. "
            f"GPU 0 has a total capacity of {total / GiB:.2f} GiB of which "
            f"{free_at_snapshot / GiB:.2f} GiB is free."
        )
    activation = activation_peak_bytes(model, tp, cfg.max_num_batched_tokens, cfg.max_num_seqs)
    sizes = cudagraph_capture_sizes(cfg.max_num_seqs, cfg.max_num_batched_tokens, gpu.sm100)
    cudagraph = len(sizes) * model.num_hidden_layers * MEMORY.cudagraph_bytes_per_size_layer
    nontorch = MEMORY.nontorch_bytes + (MEMORY.nontorch_tp_extra_bytes if tp > 1 else 0)
    available = requested - weights - activation - nontorch - cudagraph
    if available <= 0:
        raise StartupError(
            "No available memory for the cache blocks. Try increasing `gpu_memory_utilization` "
            f"when initializing the engine. {_CONSERVING_MEMORY}"
        )
    dtype_bytes = kv_dtype_bytes(cfg.kv_cache_dtype, model)
    per_token = model.kv_bytes_per_token(tp, dtype_bytes)
    per_block = per_token * cfg.block_size
    num_blocks = available // per_block
    mml = cfg.max_model_len
    if cfg.num_gpu_blocks_override is not None:
        num_blocks = cfg.num_gpu_blocks_override
        available = num_blocks * per_block
    blocks_per_seq = ceil_div(mml, cfg.block_size)
    needed = blocks_per_seq * per_block
    usable = available - per_block  # the check leaves out the null block
    if needed > usable:
        estimated = max(0, (usable // per_block)) * cfg.block_size
        raise StartupError(
            f"To serve at least one request with the model's max seq len ({mml}), "
            f"({needed / GiB:.2f} GiB KV cache is needed, which is larger than the available KV "
            f"cache memory ({usable / GiB:.2f} GiB). Based on the available memory, the "
            f"estimated maximum model length is {estimated}. Try increasing "
            "`gpu_memory_utilization` or decreasing `max_model_len` when initializing the "
            f"engine. {_CONSERVING_MEMORY}"
        )
    max_concurrency = num_blocks / blocks_per_seq
    return KVCacheInfo(
        num_gpu_blocks=int(num_blocks),
        block_size=cfg.block_size,
        kv_bytes_per_token=per_token,
        kv_dtype_bytes=dtype_bytes,
        kv_cache_size_tokens=int(max_concurrency * mml),
        kv_cache_memory_bytes=int(num_blocks * per_block),
        max_concurrency=max_concurrency,
        requested_memory_bytes=requested,
        weights_bytes=weights,
        activation_bytes=activation,
        cudagraph_bytes=cudagraph,
        nontorch_bytes=nontorch,
        num_cudagraph_sizes=len(sizes),
    )
