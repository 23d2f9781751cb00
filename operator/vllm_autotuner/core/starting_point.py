"""The knobs a VLLMDeployment starts from, before the tuner has measured anything.

What the spec pins wins; what it leaves out is what `vllm serve` would choose by itself on that
GPU. Under a policy, the result is clamped into the policy's bounds (and the clamping is said
out loud), so nothing outside what the platform team allowed is ever deployed.
"""

from __future__ import annotations

from dataclasses import dataclass

from vllm_autotuner.api.deployment import VLLMDeploymentSpec
from vllm_autotuner.api.policy import VLLMTuningPolicySpec
from vllm_autotuner.core.knob_defaults import default_knobs
from vllm_autotuner.core.tuning_types import Knobs


@dataclass(frozen=True)
class StartingPoint:
    knobs: Knobs
    notes: tuple[str, ...] = ()


def _clamp(name: str, value: float, low: float, high: float, notes: list[str]) -> float:
    if value < low or value > high:
        clamped = min(max(value, low), high)
        notes.append(
            f"{name} {value:g} is outside the policy's bounds [{low:g}, {high:g}]; "
            f"using {clamped:g}"
        )
        return clamped
    return value


def starting_knobs(spec: VLLMDeploymentSpec, policy: VLLMTuningPolicySpec | None) -> StartingPoint:
    defaults = default_knobs(spec.gpu.product, spec.gpu.memory_gib, spec.engine.max_model_len)
    pinned = spec.knobs
    mnbt = pinned.max_num_batched_tokens or defaults.max_num_batched_tokens
    mns = pinned.max_num_seqs or defaults.max_num_seqs
    gmu = pinned.gpu_memory_utilization or defaults.gpu_memory_utilization
    notes: list[str] = []
    if policy is not None:
        b = policy.bounds
        mnbt = int(
            _clamp(
                "maxNumBatchedTokens",
                mnbt,
                b.max_num_batched_tokens.min,
                b.max_num_batched_tokens.max,
                notes,
            )
        )
        mns = int(_clamp("maxNumSeqs", mns, b.max_num_seqs.min, b.max_num_seqs.max, notes))
        gmu = _clamp(
            "gpuMemoryUtilization",
            gmu,
            b.gpu_memory_utilization.min,
            b.gpu_memory_utilization.max,
            notes,
        )
    if mns > mnbt:
        # vLLM refuses max_num_batched_tokens < max_num_seqs at start-up (vLLM arg_utils.py).
        notes.append(f"maxNumSeqs {mns} exceeds maxNumBatchedTokens {mnbt}; using {mnbt}")
        mns = mnbt
    return StartingPoint(
        knobs=Knobs(max_num_batched_tokens=mnbt, max_num_seqs=mns, gpu_memory_utilization=gmu),
        notes=tuple(notes),
    )
