"""Models and GPUs the simulator knows, described the way their owners describe them.

A model is a Hugging Face style config.json (the same keys vLLM reads), so a model nobody
catalogued can be simulated from its config file alone. A GPU is a small spec of the numbers a
roofline needs. Everything the step-time and KV models use is derived from these two records.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

GiB = 1 << 30

_DTYPE_BYTES = {"bfloat16": 2, "float16": 2, "float32": 4, "fp8": 1, "float8_e4m3fn": 1}


@dataclass(frozen=True)
class ModelSpec:
    """A decoder-only transformer as its config.json describes it (dense or mixture-of-experts)."""

    name: str
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    max_position_embeddings: int
    tie_word_embeddings: bool = False
    num_local_experts: int = 1
    num_experts_per_tok: int = 1
    dtype_bytes: int = 2

    @classmethod
    def from_hf_config(cls, name: str, cfg: dict[str, Any]) -> ModelSpec:
        heads = int(cfg["num_attention_heads"])
        hidden = int(cfg["hidden_size"])
        head_dim = cfg.get("head_dim") or hidden // heads
        dtype = str(cfg.get("torch_dtype", cfg.get("dtype", "bfloat16")))
        return cls(
            name=name,
            hidden_size=hidden,
            num_hidden_layers=int(cfg["num_hidden_layers"]),
            num_attention_heads=heads,
            num_key_value_heads=int(cfg.get("num_key_value_heads") or heads),
            head_dim=int(head_dim),
            intermediate_size=int(cfg["intermediate_size"]),
            vocab_size=int(cfg["vocab_size"]),
            max_position_embeddings=int(cfg.get("max_position_embeddings", 4096)),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            num_local_experts=int(cfg.get("num_local_experts") or cfg.get("num_experts") or 1),
            num_experts_per_tok=int(cfg.get("num_experts_per_tok") or 1),
            dtype_bytes=_DTYPE_BYTES.get(dtype, 2),
        )

    # Parameter counts. SwiGLU MLPs have THREE matrices (gate, up, down); counting two (as BLIS's
    # roofline does) undercounts decode bytes by a third (BLIS, inference-sim).
    @property
    def attention_params_per_layer(self) -> int:
        q_out = self.num_attention_heads * self.head_dim
        kv_out = self.num_key_value_heads * self.head_dim
        return self.hidden_size * (2 * q_out + 2 * kv_out)

    @property
    def expert_params(self) -> int:
        return 3 * self.hidden_size * self.intermediate_size

    @property
    def is_moe(self) -> bool:
        return self.num_local_experts > 1

    @property
    def layer_params_dense_part(self) -> int:
        """Attention, norms and router: read once per step whatever the batch."""
        router = self.hidden_size * self.num_local_experts if self.is_moe else 0
        return self.attention_params_per_layer + 2 * self.hidden_size + router

    @property
    def embedding_params(self) -> int:
        return self.vocab_size * self.hidden_size

    @property
    def lm_head_params(self) -> int:
        return 0 if self.tie_word_embeddings else self.vocab_size * self.hidden_size

    @property
    def total_params(self) -> int:
        per_layer = self.layer_params_dense_part + self.num_local_experts * self.expert_params
        return self.num_hidden_layers * per_layer + self.embedding_params + self.lm_head_params

    @property
    def active_params_per_token(self) -> int:
        """Params that multiply each token (no embedding lookup; the lm_head is counted apart)."""
        per_layer = self.layer_params_dense_part + self.num_experts_per_tok * self.expert_params
        return self.num_hidden_layers * per_layer

    @property
    def weights_bytes(self) -> int:
        return self.total_params * self.dtype_bytes

    def expected_experts_touched(self, tokens: float) -> float:
        """Distinct experts a layer reads for `tokens` tokens routed top-k uniformly at random."""
        if not self.is_moe:
            return 1.0
        e, k = self.num_local_experts, self.num_experts_per_tok
        return float(e * (1.0 - (1.0 - k / e) ** max(tokens, 0.0)))

    def streamed_weight_bytes(self, tokens: float) -> float:
        """Weight bytes one forward pass over `tokens` tokens reads from HBM (all ranks together).

        The embedding table is only gathered (a few rows), the lm_head is read whole.
        """
        experts = self.expected_experts_touched(tokens) if self.is_moe else 1.0
        per_layer = self.layer_params_dense_part + experts * self.expert_params
        head = self.vocab_size * self.hidden_size
        return (self.num_hidden_layers * per_layer + head) * self.dtype_bytes

    def kv_heads_per_rank(self, tp: int) -> int:
        """vLLM replicates KV heads when TP exceeds them (ModelConfig.get_num_kv_heads)."""
        return max(1, self.num_key_value_heads // tp)

    def kv_bytes_per_token(self, tp: int, kv_dtype_bytes: int) -> int:
        """Per GPU: 2 (K and V) x layers x kv heads per rank x head_dim x dtype
        (vLLM kv_cache_interface.py)."""
        return (
            2 * self.num_hidden_layers * self.kv_heads_per_rank(tp) * self.head_dim * kv_dtype_bytes
        )


@dataclass(frozen=True)
class GpuSpec:
    """The roofline numbers of one GPU (dense, no sparsity)."""

    name: str
    device_name: str  # what torch.cuda.get_device_name reports; vLLM's tier rule reads it
    memory_bytes: int  # total device memory as torch reports it
    hbm_bandwidth: float  # bytes/s, peak
    bf16_flops: float  # FLOP/s, dense peak
    fp8_flops: float | None  # FLOP/s, dense peak; None where the GPU has no FP8 tensor cores
    interconnect_bandwidth: float  # bytes/s per direction per GPU (NVLink or PCIe)
    # Streaming multiprocessors: how many attention work units run at once (steptime's KV tail).
    sm_count: int = 132
    sm100: bool = False  # Blackwell: larger default CUDA-graph capture size (vLLM config/vllm.py)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> GpuSpec:
        return cls(
            name=str(d["name"]),
            device_name=str(d.get("device_name", d["name"])),
            memory_bytes=int(float(d["memory_gib"]) * GiB),
            hbm_bandwidth=float(d["hbm_tb_s"]) * 1e12,
            bf16_flops=float(d["bf16_tflops"]) * 1e12,
            fp8_flops=None if d.get("fp8_tflops") is None else float(d["fp8_tflops"]) * 1e12,
            interconnect_bandwidth=float(d.get("interconnect_gb_s", 32.0)) * 1e9,
            sm_count=int(d.get("sm_count", 132)),
            sm100=bool(d.get("sm100", False)),
        )

    @property
    def memory_gib(self) -> float:
        return self.memory_bytes / GiB


def _llama(
    hidden: int, layers: int, heads: int, kv: int, inter: int, vocab: int, mpe: int
) -> dict[str, Any]:
    return {
        "hidden_size": hidden,
        "num_hidden_layers": layers,
        "num_attention_heads": heads,
        "num_key_value_heads": kv,
        "head_dim": 128,
        "intermediate_size": inter,
        "vocab_size": vocab,
        "max_position_embeddings": mpe,
        "tie_word_embeddings": False,
        "torch_dtype": "bfloat16",
    }


# config.json values as published on the Hugging Face Hub for each model (architecture fields only).
MODEL_CONFIGS: dict[str, dict[str, Any]] = {
    "meta-llama/Llama-3.1-8B-Instruct": _llama(4096, 32, 32, 8, 14336, 128256, 131072),
    "meta-llama/Llama-3.1-70B-Instruct": _llama(8192, 80, 64, 8, 28672, 128256, 131072),
    "Qwen/Qwen2.5-7B-Instruct": _llama(3584, 28, 28, 4, 18944, 152064, 32768),
    "Qwen/Qwen2.5-32B-Instruct": _llama(5120, 64, 40, 8, 27648, 152064, 32768),
    "mistralai/Mistral-7B-Instruct-v0.3": _llama(4096, 32, 32, 8, 14336, 32768, 32768),
    "mistralai/Mixtral-8x7B-Instruct-v0.1": {
        **_llama(4096, 32, 32, 8, 14336, 32000, 32768),
        "num_local_experts": 8,
        "num_experts_per_tok": 2,
    },
    # The calibration set (the inference-sim project's runs).
    "meta-llama/Llama-2-7b-hf": _llama(4096, 32, 32, 32, 11008, 32000, 4096),
    "codellama/CodeLlama-34b-Instruct-hf": _llama(8192, 48, 64, 8, 22016, 32000, 16384),
    "meta-llama/Llama-2-70b-hf": _llama(8192, 80, 64, 8, 28672, 32000, 4096),
}
MODEL_ALIASES = {
    "mistralai/Mixtral-8x7B-v0.1": "mistralai/Mixtral-8x7B-Instruct-v0.1",
    "meta-llama/Llama-3.1-8B": "meta-llama/Llama-3.1-8B-Instruct",
    "meta-llama/Llama-3.1-70B": "meta-llama/Llama-3.1-70B-Instruct",
    "meta-llama/Llama-2-7b-chat-hf": "meta-llama/Llama-2-7b-hf",
    "meta-llama/Llama-2-70b-chat-hf": "meta-llama/Llama-2-70b-hf",
    "meta-llama/Meta-Llama-3-70B-Instruct": "meta-llama/Llama-3.1-70B-Instruct",
}

# Memory is what torch reports as total capacity (a little under the marketing GB); bandwidth and
# dense TFLOPS from NVIDIA datasheets (NVIDIA datasheets). B200: NVIDIA DGX B200
# datasheet (8 TB/s, 2.25 PFLOPS dense BF16 per GPU). Interconnect: NVLink per direction
# (A100 300, H100/H200 450, B200 900 GB/s); L40S has no NVLink (PCIe Gen4 x16, ~25 GB/s achieved).
# SM counts: NVIDIA's A100 and H100 architecture whitepapers (108; 132 for H100 SXM, and H200 is
# the same GH100 configuration), the L40S datasheet (142), the B200 (148).
GPU_SPECS: dict[str, dict[str, Any]] = {
    "A100-40GB": {
        "device_name": "NVIDIA A100-SXM4-40GB",
        "memory_gib": 39.39,
        "hbm_tb_s": 1.555,
        "bf16_tflops": 312,
        "fp8_tflops": None,
        "interconnect_gb_s": 300,
        "sm_count": 108,
    },
    "A100-80GB": {
        "device_name": "NVIDIA A100-SXM4-80GB",
        "memory_gib": 79.15,
        "hbm_tb_s": 2.039,
        "bf16_tflops": 312,
        "fp8_tflops": None,
        "interconnect_gb_s": 300,
        "sm_count": 108,
    },
    "H100": {
        "device_name": "NVIDIA H100 80GB HBM3",
        "memory_gib": 79.19,
        "hbm_tb_s": 3.35,
        "bf16_tflops": 989,
        "fp8_tflops": 1979,
        "interconnect_gb_s": 450,
        "sm_count": 132,
    },
    "H200": {
        "device_name": "NVIDIA H200",
        "memory_gib": 139.81,
        "hbm_tb_s": 4.8,
        "bf16_tflops": 989,
        "fp8_tflops": 1979,
        "interconnect_gb_s": 450,
        "sm_count": 132,
    },
    "L40S": {
        "device_name": "NVIDIA L40S",
        "memory_gib": 44.39,
        "hbm_tb_s": 0.864,
        "bf16_tflops": 362,
        "fp8_tflops": 733,
        "interconnect_gb_s": 25,
        "sm_count": 142,
    },
    "B200": {
        "device_name": "NVIDIA B200",
        "memory_gib": 178.35,
        "hbm_tb_s": 8.0,
        "bf16_tflops": 2250,
        "fp8_tflops": 4500,
        "interconnect_gb_s": 900,
        "sm_count": 148,
        "sm100": True,
    },
}
GPU_ALIASES = {"A100": "A100-80GB", "H100-80GB": "H100", "H100-SXM": "H100", "H200-141GB": "H200"}


def model_names() -> list[str]:
    return list(MODEL_CONFIGS)


def gpu_names() -> list[str]:
    return list(GPU_SPECS)


def _lookup(name: str, table: dict[str, Any], aliases: dict[str, str]) -> str | None:
    name = aliases.get(name, name)
    if name in table:
        return name
    low = name.lower()
    for key in list(table) + list(aliases):
        if low in (key.lower(), key.split("/")[-1].lower()):
            return aliases.get(key, key)
    return None


def load_model(name_or_path: str) -> ModelSpec:
    """A catalog name (case-insensitive, with or without the org) or a path to a config.json."""
    key = _lookup(name_or_path, MODEL_CONFIGS, MODEL_ALIASES)
    if key is not None:
        return ModelSpec.from_hf_config(key, MODEL_CONFIGS[key])
    path = Path(name_or_path)
    if path.is_dir():
        path = path / "config.json"
    if path.is_file():
        return ModelSpec.from_hf_config(name_or_path, json.loads(path.read_text()))
    raise ValueError(f"unknown model {name_or_path!r}: not in the catalog and not a config.json")


def load_gpu(name_or_path: str) -> GpuSpec:
    """A catalog name or a path to a JSON spec with the keys of GPU_SPECS's entries plus name."""
    key = _lookup(name_or_path, GPU_SPECS, GPU_ALIASES)
    if key is not None:
        return GpuSpec.from_dict({"name": key, **GPU_SPECS[key]})
    path = Path(name_or_path)
    if path.is_file():
        d = json.loads(path.read_text())
        d.setdefault("name", path.stem)
        return GpuSpec.from_dict(d)
    raise ValueError(f"unknown GPU {name_or_path!r}: not in the catalog and not a spec file")


def ceil_div(a: int, b: int) -> int:
    return -(-a // b)


__all__ = [
    "GPU_SPECS",
    "MODEL_CONFIGS",
    "GiB",
    "GpuSpec",
    "ModelSpec",
    "ceil_div",
    "gpu_names",
    "load_gpu",
    "load_model",
    "model_names",
]
