"""vLLM's own starting point for the three knobs, per GPU.

The tuner starts where vLLM would (vLLM 0.33 `EngineArgs.get_batch_defaults` and
`_set_default_max_num_seqs_and_batched_tokens_args`, vLLM arg_utils.py) so that an
untuned deployment behaves exactly like a hand-written `vllm serve`, and every later change is
measured against that familiar baseline.
"""

from __future__ import annotations

from vllm_autotuner.core.tuning_types import Knobs

GIB = 2**30

# vLLM >= 0.20 default (vLLM arg_utils.py). 0.34 resolves None to 1.0 only with the
# extensible KV cache; the tuner keeps the classic value as a conservative start.
DEFAULT_GPU_MEMORY_UTILIZATION = 0.92

# Memory per GPU in GiB as CUDA reports it (approximately the marketing GB figure; the tier
# thresholds below are far from every boundary, so the difference never changes a tier).
GPU_MEMORY_GIB: dict[str, float] = {
    "B300": 288.0,
    "B200": 180.0,
    "GB200": 186.0,
    "MI355X": 288.0,
    "MI325X": 256.0,
    "MI300X": 192.0,
    "H200": 141.0,
    "GH200": 96.0,
    "H100": 80.0,
    "H100-PCIE": 80.0,
    "H100-NVL": 94.0,
    "H800": 80.0,
    "H20": 96.0,
    "A100-80GB": 80.0,
    "A100-40GB": 40.0,
    "A100": 80.0,
    "L40S": 48.0,
    "L40": 48.0,
    "L4": 24.0,
    "A10G": 24.0,
    "A10": 24.0,
    "RTX-4090": 24.0,
    "RTX-6000-ADA": 48.0,
    "T4": 16.0,
    "V100": 32.0,
}


def _normalise(product: str) -> str:
    """Map 'NVIDIA-H100-80GB-HBM3' (the GPU feature discovery label) or 'h100' to a table key."""
    p = product.upper().replace("_", "-").replace(" ", "-")
    for prefix in ("NVIDIA-", "AMD-", "TESLA-", "GEFORCE-"):
        if p.startswith(prefix):
            p = p[len(prefix) :]
    return p


def gpu_memory_gib(product: str | None) -> float | None:
    """Memory of one GPU of this product, or None when the product is unknown."""
    if not product:
        return None
    p = _normalise(product)
    if p in GPU_MEMORY_GIB:
        return GPU_MEMORY_GIB[p]
    # Longest key that prefixes the product ("A100-SXM4-40GB" → A100 with the 40GB suffix).
    if p.startswith("A100"):
        return 40.0 if "40G" in p else 80.0
    for key in sorted(GPU_MEMORY_GIB, key=len, reverse=True):
        if p.startswith(key):
            return GPU_MEMORY_GIB[key]
    return None


def api_server_batch_defaults(product: str | None, memory_gib: float | None) -> tuple[int, int]:
    """(max_num_batched_tokens, max_num_seqs) of `vllm serve` before post-processing.

    Tiers from vLLM arg_utils.py, checked in order: >=160 GiB → 16384/1024; >=70 GiB and not an
    A100 and not GB10 → 8192/1024; everything else (unknown included) → 2048/256.
    """
    mem = memory_gib if memory_gib is not None else gpu_memory_gib(product)
    name = (product or "").lower()
    if mem is None:
        return 2048, 256
    if mem >= 160:
        return 16384, 1024
    if mem >= 70 and "a100" not in name and "gb10" not in name:
        return 8192, 1024
    return 2048, 256


def default_knobs(
    gpu_product: str | None,
    gpu_memory_gib_: float | None = None,
    max_model_len: int | None = None,
    performance_mode: str = "balanced",
) -> Knobs:
    """The knobs `vllm serve` would pick by itself on this GPU (tier, performance mode, cap)."""
    mnbt, mns = api_server_batch_defaults(gpu_product, gpu_memory_gib_)
    if performance_mode == "throughput":
        mnbt, mns = mnbt * 2, mns * 2
    if max_model_len is not None and max_model_len > 0:
        mnbt = min(mns * max_model_len, mnbt)
    mns = min(mns, mnbt)
    return Knobs(
        max_num_batched_tokens=mnbt,
        max_num_seqs=mns,
        gpu_memory_utilization=DEFAULT_GPU_MEMORY_UTILIZATION,
    )
