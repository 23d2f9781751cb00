"""What vLLM itself would refuse at start-up, checked before a pod is rendered.

A Deployment vLLM refuses to start crash-loops on GPUs that stay reserved, and the tuner reads
the crash as a hidden constraint of the knobs. Each check here restates one of vLLM's own
start-up checks (vllm/config: ModelConfig.verify_with_parallel_config, the attention heads must
divide by the tensor-parallel size; and the context length may not exceed the model's
``max_position_embeddings`` unless VLLM_ALLOW_LONG_MAX_MODEL_LEN is set, which extraArgs and env
cannot do here). The model's numbers come from the simulator's catalog, so only catalogued
models are checked; the knob checks vLLM makes (max_num_batched_tokens >= max_num_seqs, the
budget against max_model_len without chunked prefill, utilisation in (0, 1]) are enforced by the
API models and the policy's validation instead.
"""

from __future__ import annotations

from typing import Any

from vllm_autotuner.api.deployment import VLLMDeploymentSpec
from vllm_sim.catalog import MODEL_ALIASES, MODEL_CONFIGS


def model_config(model: str) -> dict[str, Any] | None:
    """The catalogued config.json of ``model`` (with or without its org, any case), or None."""
    name = MODEL_ALIASES.get(model, model)
    if name in MODEL_CONFIGS:
        return dict(MODEL_CONFIGS[name])
    low = name.lower()
    for key in [*MODEL_CONFIGS, *MODEL_ALIASES]:
        if low in (key.lower(), key.split("/")[-1].lower()):
            return dict(MODEL_CONFIGS[MODEL_ALIASES.get(key, key)])
    return None


def startup_refusal(spec: VLLMDeploymentSpec) -> str | None:
    """Why vLLM would refuse to start this spec, or None when nothing we know of would."""
    cfg = model_config(spec.model)
    if cfg is None:
        return None
    tp = spec.engine.tensor_parallel_size
    heads = int(cfg.get("num_attention_heads") or 0)
    if heads and heads % tp:
        return (
            f"vLLM refuses engine.tensorParallelSize {tp} for {spec.model}: its {heads} "
            f"attention heads are not divisible by {tp}"
        )
    context = int(cfg.get("max_position_embeddings") or 0)
    wanted = spec.engine.max_model_len
    if context and wanted is not None and wanted > context:
        return (
            f"vLLM refuses engine.maxModelLen {wanted} for {spec.model}: the model's context "
            f"is {context} tokens (max_position_embeddings)"
        )
    return None
