"""Models and GPUs the simulator knows, described the way their owners describe them.

A model is a Hugging Face style config.json (the same keys vLLM reads), so a model nobody
catalogued can be simulated from its config file alone. A GPU is a small spec of the numbers a
roofline needs. Everything the step-time and KV models use is derived from these two records.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

GiB = 1 << 30

_DTYPE_BYTES = {"bfloat16": 2, "float16": 2, "float32": 4, "fp8": 1, "float8_e4m3fn": 1}
# Tensor-core types a GEMM can run on (GpuSpec.peak_flops).
BF16, FP8, INT8 = "bf16", "fp8", "int8"


@dataclass(frozen=True)
class Quantization:
    """How a checkpoint stores and multiplies its quantized linear layers.

    `weight_bits` counts the stored bits per weight including per-group scales (AWQ/GPTQ 4-bit
    with group 128 and fp16 scales: 4.125). `compute` is the tensor-core type the GEMMs run on
    when the GPU has it: W8A8 FP8 on FP8 tensor cores, W8A8 INT8 on INT8 ones, weight-only
    schemes in BF16 (the weights are dequantized in the kernel, e.g. Marlin). Embeddings, the
    lm_head and MoE routers stay in the activation dtype, as vLLM's checkpoints ignore them.
    """

    method: str = "none"
    weight_bits: float = 16.0
    compute: str = BF16

    @property
    def quantized(self) -> bool:
        return self.method != "none"


NO_QUANT = Quantization()


def quantization_from_config(qc: Any, where: str = "quantization_config") -> Quantization:
    """A Hugging Face `quantization_config` (fp8, compressed-tensors, AWQ, GPTQ, bitsandbytes,
    modelopt, mxfp4) as stored bits and GEMM type; unknown methods are an error."""
    if not isinstance(qc, Mapping):
        raise ValueError(f"{where}: expected a mapping, got {qc!r}")
    method = str(qc.get("quant_method", "")).lower()
    if method == "fp8":
        return Quantization("fp8", 8.0, FP8)
    if method == "compressed-tensors":
        return _compressed_tensors(qc, where)
    if method in ("awq", "gptq", "awq_marlin", "gptq_marlin"):
        bits = int(qc.get("bits", qc.get("w_bit", 4)))
        group = int(qc.get("group_size", qc.get("q_group_size", 128)) or 128)
        overhead = 16.0 / group if group > 0 else 0.0
        return Quantization(method.split("_")[0], bits + overhead, BF16)
    if method == "bitsandbytes":
        four = bool(qc.get("load_in_4bit", False))
        return Quantization("bitsandbytes", 4.5 if four else 8.0, BF16)
    if method == "modelopt":
        algo = str(qc.get("quant_algo", qc.get("quantization", {}).get("quant_algo", ""))).upper()
        if "FP8" in algo:
            return Quantization("modelopt-fp8", 8.0, FP8)
        return Quantization("modelopt-fp4", 4.5, BF16)
    if method == "mxfp4":
        return Quantization("mxfp4", 4.25, BF16)
    raise ValueError(f"{where}: unsupported quant_method {method!r}")


def _compressed_tensors(qc: Mapping[str, Any], where: str) -> Quantization:
    groups = qc.get("config_groups") or {}
    if not isinstance(groups, Mapping) or not groups:
        raise ValueError(f"{where}.config_groups: expected a non-empty mapping")
    group = next(iter(groups.values()))
    weights = group.get("weights") or {}
    bits = int(weights.get("num_bits", 8))
    wtype = str(weights.get("type", "int"))
    acts = group.get("input_activations")
    if bits == 8 and isinstance(acts, Mapping) and int(acts.get("num_bits", 16)) == 8:
        return Quantization(
            f"compressed-tensors-w8a8-{wtype}", 8.0, FP8 if wtype == "float" else INT8
        )
    overhead = 0.0
    size = weights.get("group_size")
    if isinstance(size, int) and size > 0:
        overhead = 16.0 / size
    return Quantization(f"compressed-tensors-w{bits}a16", bits + overhead, BF16)


def quantization_from_flag(flag: str) -> Quantization:
    """vLLM's --quantization for an unquantized checkpoint: `fp8` quantizes it at load time to
    W8A8 FP8 with dynamic activation scales (vLLM's Fp8Config); other methods need a quantized
    checkpoint, whose config.json says so."""
    if flag.lower() == "fp8":
        return Quantization("fp8", 8.0, FP8)
    raise ValueError(
        f"--quantization {flag}: the simulator can only quantize an unquantized checkpoint to "
        "fp8; give the quantized model's config.json instead"
    )


@dataclass(frozen=True)
class ModelSpec:
    """A decoder-only transformer as its config.json describes it (dense or mixture-of-experts).

    MoE: `num_local_experts` routed experts of `moe_intermediate_size` each, `num_experts_per_tok`
    of them per token, plus `shared_expert_intermediate_size` of always-on shared expert MLP, in
    `num_moe_layers` of the layers (the others are dense MLPs of `intermediate_size`).
    `extra_params` are weights outside the text decoder (a vision tower and projector): they take
    memory but are not read by text-only steps. `dtype_bytes` is the activation dtype (what
    `--kv-cache-dtype auto` stores); `quant` says how the linear weights are stored.
    """

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
    moe_intermediate_size: int = 0  # 0: same as intermediate_size (Mixtral)
    shared_expert_intermediate_size: int = 0
    num_moe_layers: int = -1  # -1: every layer when MoE
    extra_params: int = 0
    quant: Quantization = NO_QUANT

    @classmethod
    def from_hf_config(cls, name: str, cfg: dict[str, Any]) -> ModelSpec:
        top = cfg
        if isinstance(cfg.get("text_config"), Mapping):  # multimodal: the language model
            cfg = {**{k: v for k, v in top.items() if k != "text_config"}, **top["text_config"]}
        heads = int(cfg["num_attention_heads"])
        hidden = int(cfg["hidden_size"])
        head_dim = cfg.get("head_dim") or hidden // heads
        dtype = str(cfg.get("torch_dtype", cfg.get("dtype", "bfloat16")))
        layers = int(cfg["num_hidden_layers"])
        experts = int(cfg.get("num_local_experts") or cfg.get("num_experts") or
                      cfg.get("n_routed_experts") or 1)  # fmt: skip
        quant = NO_QUANT
        if cfg.get("quantization_config") is not None:
            quant = quantization_from_config(cfg["quantization_config"])
        return cls(
            name=name,
            hidden_size=hidden,
            num_hidden_layers=layers,
            num_attention_heads=heads,
            num_key_value_heads=int(cfg.get("num_key_value_heads") or heads),
            head_dim=int(head_dim),
            intermediate_size=int(cfg.get("intermediate_size_mlp") or cfg["intermediate_size"]),
            vocab_size=int(cfg["vocab_size"]),
            max_position_embeddings=int(cfg.get("max_position_embeddings", 4096)),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            num_local_experts=experts,
            num_experts_per_tok=int(cfg.get("num_experts_per_tok") or 1),
            dtype_bytes=_DTYPE_BYTES.get(dtype, 2),
            moe_intermediate_size=_moe_intermediate(cfg, experts),
            shared_expert_intermediate_size=_shared_intermediate(cfg, experts),
            num_moe_layers=_moe_layers(cfg, layers, experts),
            extra_params=_vision_params(top.get("vision_config")),
            quant=quant,
        )

    # Parameter counts. SwiGLU MLPs have THREE matrices (gate, up, down); counting two (as BLIS's
    # roofline does) undercounts decode bytes by a third.
    @property
    def attention_params_per_layer(self) -> int:
        q_out = self.num_attention_heads * self.head_dim
        kv_out = self.num_key_value_heads * self.head_dim
        return self.hidden_size * (2 * q_out + 2 * kv_out)

    @property
    def is_moe(self) -> bool:
        return self.num_local_experts > 1

    @property
    def expert_params(self) -> int:
        return 3 * self.hidden_size * (self.moe_intermediate_size or self.intermediate_size)

    @property
    def shared_expert_params(self) -> int:
        return 3 * self.hidden_size * self.shared_expert_intermediate_size

    @property
    def dense_mlp_params(self) -> int:
        return 3 * self.hidden_size * self.intermediate_size

    @property
    def moe_layers(self) -> int:
        if not self.is_moe:
            return 0
        return self.num_hidden_layers if self.num_moe_layers < 0 else self.num_moe_layers

    @property
    def dense_layers(self) -> int:
        return self.num_hidden_layers - self.moe_layers

    @property
    def router_params(self) -> int:
        return self.moe_layers * self.hidden_size * self.num_local_experts

    @property
    def layer_params_dense_part(self) -> int:
        """Attention and norms of one layer: read once per step whatever the batch."""
        return self.attention_params_per_layer + 2 * self.hidden_size

    @property
    def embedding_params(self) -> int:
        return self.vocab_size * self.hidden_size

    @property
    def lm_head_params(self) -> int:
        return 0 if self.tie_word_embeddings else self.vocab_size * self.hidden_size

    @property
    def linear_params_always_read(self) -> int:
        """Quantizable weights every step reads whatever the batch: attention, dense MLPs and
        shared experts of every layer."""
        return (
            self.num_hidden_layers * self.layer_params_dense_part
            + self.dense_layers * self.dense_mlp_params
            + self.moe_layers * self.shared_expert_params
        )

    @property
    def total_params(self) -> int:
        routed = self.moe_layers * self.num_local_experts * self.expert_params
        return (
            self.linear_params_always_read + routed + self.router_params
            + self.embedding_params + self.lm_head_params
        )  # fmt: skip

    @property
    def active_params_per_token(self) -> int:
        """Params that multiply each token (no embedding lookup; the lm_head is counted apart)."""
        routed = self.moe_layers * self.num_experts_per_tok * self.expert_params
        return self.linear_params_always_read + routed + self.router_params

    @property
    def weight_bytes_per_param(self) -> float:
        """Stored bytes of a quantized linear weight (the activation dtype when unquantized)."""
        return self.quant.weight_bits / 8.0 if self.quant.quantized else float(self.dtype_bytes)

    @property
    def weights_bytes(self) -> int:
        """Device memory of all weights: quantized linears at their stored size; embeddings,
        lm_head, routers and any vision tower in the activation dtype."""
        routed = self.moe_layers * self.num_local_experts * self.expert_params
        linear = (self.linear_params_always_read + routed) * self.weight_bytes_per_param
        plain = self.router_params + self.embedding_params + self.lm_head_params + self.extra_params
        return int(linear + plain * self.dtype_bytes)

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
        linear = float(self.linear_params_always_read)
        if self.is_moe:
            linear += self.moe_layers * self.expected_experts_touched(tokens) * self.expert_params
        plain = self.router_params + self.vocab_size * self.hidden_size
        return linear * self.weight_bytes_per_param + plain * self.dtype_bytes

    def kv_heads_per_rank(self, tp: int) -> int:
        """vLLM replicates KV heads when TP exceeds them (ModelConfig.get_num_kv_heads)."""
        return max(1, self.num_key_value_heads // tp)

    def kv_bytes_per_token(self, tp: int, kv_dtype_bytes: int) -> int:
        """Per GPU: 2 (K and V) x layers x kv heads per rank x head_dim x dtype
        (vLLM v1/kv_cache_interface.py)."""
        return (
            2 * self.num_hidden_layers * self.kv_heads_per_rank(tp) * self.head_dim * kv_dtype_bytes
        )


def _moe_intermediate(cfg: Mapping[str, Any], experts: int) -> int:
    if experts <= 1:
        return 0
    # Llama-4 names its expert size intermediate_size (and the dense one intermediate_size_mlp).
    if cfg.get("intermediate_size_mlp"):
        return int(cfg["intermediate_size"])
    return int(cfg.get("moe_intermediate_size") or 0)


def _shared_intermediate(cfg: Mapping[str, Any], experts: int) -> int:
    """Total intermediate size of the always-on shared experts (0: none)."""
    if experts <= 1:
        return 0
    if cfg.get("shared_expert_intermediate_size"):  # Qwen2-MoE
        return int(cfg["shared_expert_intermediate_size"])
    if cfg.get("n_shared_experts"):  # DeepSeek: n shared experts of moe_intermediate_size
        return int(cfg["n_shared_experts"]) * int(cfg.get("moe_intermediate_size") or 0)
    if cfg.get("intermediate_size_mlp"):  # Llama-4: one shared expert of the expert size
        return int(cfg["intermediate_size"])
    return 0


def _moe_layers(cfg: Mapping[str, Any], layers: int, experts: int) -> int:
    if experts <= 1:
        return 0
    if cfg.get("moe_layers"):  # an explicit list of MoE layer indices
        return len(cfg["moe_layers"])
    step = int(cfg.get("interleave_moe_layer_step") or 1)  # Llama-4: every step-th layer
    dense_first = int(cfg.get("first_k_dense_replace") or 0)  # DeepSeek: first k are dense
    return (layers - dense_first) // step


def _vision_params(vc: Any) -> int:
    """A ViT's parameters from its config (attention 4h^2, MLP 2 h x inter per layer, patch
    embedding and projector): memory the text-only config does not describe."""
    if not isinstance(vc, Mapping) or not vc.get("hidden_size"):
        return 0
    h = int(vc["hidden_size"])
    layers = int(vc.get("num_hidden_layers") or vc.get("depth") or 0)
    inter = int(vc.get("intermediate_size") or 4 * h)
    patch = int(vc.get("patch_size") or 14)
    per_layer = 4 * h * h + 2 * h * inter
    patch_embed = 3 * patch * patch * h
    out = int(vc.get("projector_output_dim") or vc.get("vision_output_dim") or h)
    projector = int(vc.get("projector_input_dim") or h) * out
    return layers * per_layer + patch_embed + projector


# Achievable / peak memory bandwidth by memory technology, as public microbenchmarks measure it
# (a large device-to-device copy or STREAM triad; what well-written streaming kernels reach):
# - HBM3, H100 SXM: 3.0-3.1 of 3.35 TB/s (CUDA-event timed D2D copy and triad, ~3.05 median).
# - HBM2e, A100-80GB SXM: 1.80 of 2.04 TB/s, 88%, measured with Nsight Compute on a read kernel
#   (NVIDIA developer forum "Trouble to reach peak bandwidth of A100"; the GTC talk it cites
#   puts every kernel at or under ~90%).
# - GDDR6 with ECC, L40S: ~0.72 of 0.864 TB/s, 83% (the L40S validation target of an HPC setup
#   guide's torch copy benchmark); GDDR6 loses more to ECC and refresh than HBM.
# - HBM2 and HBM3e: no measurement at hand; taken as their neighbours (0.88, 0.90).
ACHIEVABLE_FRACTION = {"HBM2": 0.88, "HBM2e": 0.88, "HBM3": 0.91, "HBM3e": 0.90, "GDDR6": 0.83}


@dataclass(frozen=True)
class GpuSpec:
    """The physics of one GPU that the step-time model needs (dense numbers, no sparsity).

    The fitted efficiencies of vllm_sim.steptime are shared by every GPU; what differs between
    GPUs is only what is here: peak and achievable memory bandwidth (memory technology), the
    tensor-core peaks per type, the SM count and clock (how many attention work units run at
    once, and how long a small kernel takes), the L2 size and the interconnect.
    """

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
    memory_tech: str = "HBM3"
    achievable_bandwidth: float = 0.0  # bytes/s a streaming kernel reaches; 0: from memory_tech
    int8_ops: float = 0.0  # OP/s dense; 0: twice BF16
    boost_clock_ghz: float = 1.98
    l2_mib: float = 50.0
    # Hopper and later stream GEMM operands with TMA into asynchronous warpgroup MMAs, so a
    # kernel's loads and math overlap; Ampere and Ada issue synchronous MMAs behind cp.async.
    async_mma: bool = True

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> GpuSpec:
        bf16 = float(d["bf16_tflops"]) * 1e12
        tech = str(d.get("memory_tech", "HBM3"))
        if tech not in ACHIEVABLE_FRACTION:
            raise ValueError(f"memory_tech {tech!r}: expected one of {sorted(ACHIEVABLE_FRACTION)}")
        peak = float(d["hbm_tb_s"]) * 1e12
        achievable = d.get("achievable_tb_s")
        return cls(
            name=str(d["name"]),
            device_name=str(d.get("device_name", d["name"])),
            memory_bytes=int(float(d["memory_gib"]) * GiB),
            hbm_bandwidth=peak,
            bf16_flops=bf16,
            fp8_flops=None if d.get("fp8_tflops") is None else float(d["fp8_tflops"]) * 1e12,
            interconnect_bandwidth=float(d.get("interconnect_gb_s", 32.0)) * 1e9,
            sm_count=int(d.get("sm_count", 132)),
            sm100=bool(d.get("sm100", False)),
            memory_tech=tech,
            achievable_bandwidth=(
                float(achievable) * 1e12 if achievable else peak * ACHIEVABLE_FRACTION[tech]
            ),
            int8_ops=float(d.get("int8_tops", 0.0)) * 1e12 or 2.0 * bf16,
            boost_clock_ghz=float(d.get("boost_clock_ghz", 1.98)),
            l2_mib=float(d.get("l2_mib", 50.0)),
            async_mma=bool(d.get("async_mma", True)),
        )

    @property
    def memory_gib(self) -> float:
        return self.memory_bytes / GiB

    def peak_flops(self, kind: str) -> float:
        """Dense tensor-core peak for a GEMM type; FP8 GEMMs on a GPU without FP8 tensor cores
        run as weight-only FP8 (dequantized to BF16 in the kernel, as vLLM's Marlin path)."""
        if kind == FP8:
            return self.fp8_flops if self.fp8_flops is not None else self.bf16_flops
        if kind == INT8:
            return self.int8_ops
        return self.bf16_flops


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
    # Llama-4-Scout: a multimodal config.json (text_config + vision_config); 16 routed experts
    # (top-1) plus one shared expert in every layer, 8192 wide each.
    "meta-llama/Llama-4-Scout-17B-16E-Instruct": {
        "architectures": ["Llama4ForConditionalGeneration"],
        "text_config": {
            **_llama(5120, 48, 40, 8, 8192, 202048, 10485760),
            "intermediate_size_mlp": 16384,
            "num_local_experts": 16,
            "num_experts_per_tok": 1,
            "interleave_moe_layer_step": 1,
            "attention_chunk_size": 8192,
        },
        "vision_config": {
            "hidden_size": 1408,
            "num_hidden_layers": 34,
            "intermediate_size": 5632,
            "num_attention_heads": 16,
            "patch_size": 14,
            "image_size": 336,
            "projector_input_dim": 4096,
            "projector_output_dim": 4096,
        },
        "torch_dtype": "bfloat16",
    },
    # The calibration set of the real runs (H100).
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
    "meta-llama/Llama-4-Scout-17B-16E": "meta-llama/Llama-4-Scout-17B-16E-Instruct",
}

# Memory is what torch reports as total capacity (a little under the marketing GB); peak bandwidth
# and dense tensor TFLOPS/TOPS from NVIDIA's datasheets (A100, H100, H200, L40S; DGX B200: 8 TB/s,
# 2.25 PFLOPS dense BF16 per GPU); achievable bandwidth: ACHIEVABLE_FRACTION above (A100-80GB and
# H100 measured). Interconnect: NVLink per direction (A100 300, H100/H200 450, B200 900 GB/s);
# L40S has no NVLink (PCIe Gen4 x16, ~25 GB/s achieved). SM counts, boost clocks and L2 sizes:
# NVIDIA's A100 and H100 architecture whitepapers (108 SMs, 1.41 GHz, 40 MB; 132 SMs, 1.98 GHz,
# 50 MB for H100 SXM, and H200 is the same GH100 configuration), the L40S datasheet and AD102
# whitepaper (142 SMs, 2.52 GHz, 96 MB), the B200 (148 SMs).
GPU_SPECS: dict[str, dict[str, Any]] = {
    "A100-40GB": {
        "device_name": "NVIDIA A100-SXM4-40GB",
        "memory_gib": 39.39,
        "memory_tech": "HBM2",
        "hbm_tb_s": 1.555,
        "bf16_tflops": 312,
        "fp8_tflops": None,
        "int8_tops": 624,
        "interconnect_gb_s": 300,
        "sm_count": 108,
        "boost_clock_ghz": 1.41,
        "l2_mib": 40,
        "async_mma": False,
    },
    "A100-80GB": {
        "device_name": "NVIDIA A100-SXM4-80GB",
        "memory_gib": 79.15,
        "memory_tech": "HBM2e",
        "hbm_tb_s": 2.039,
        "achievable_tb_s": 1.80,
        "bf16_tflops": 312,
        "fp8_tflops": None,
        "int8_tops": 624,
        "interconnect_gb_s": 300,
        "sm_count": 108,
        "boost_clock_ghz": 1.41,
        "l2_mib": 40,
        "async_mma": False,
    },
    "H100": {
        "device_name": "NVIDIA H100 80GB HBM3",
        "memory_gib": 79.19,
        "memory_tech": "HBM3",
        "hbm_tb_s": 3.35,
        "achievable_tb_s": 3.05,
        "bf16_tflops": 989,
        "fp8_tflops": 1979,
        "int8_tops": 1979,
        "interconnect_gb_s": 450,
        "sm_count": 132,
        "boost_clock_ghz": 1.98,
        "l2_mib": 50,
    },
    "H200": {
        "device_name": "NVIDIA H200",
        "memory_gib": 139.81,
        "memory_tech": "HBM3e",
        "hbm_tb_s": 4.8,
        "bf16_tflops": 989,
        "fp8_tflops": 1979,
        "int8_tops": 1979,
        "interconnect_gb_s": 450,
        "sm_count": 132,
        "boost_clock_ghz": 1.98,
        "l2_mib": 50,
    },
    "L40S": {
        "device_name": "NVIDIA L40S",
        "memory_gib": 44.39,
        "memory_tech": "GDDR6",
        "hbm_tb_s": 0.864,
        "bf16_tflops": 362,
        "fp8_tflops": 733,
        "int8_tops": 733,
        "interconnect_gb_s": 25,
        "sm_count": 142,
        "boost_clock_ghz": 2.52,
        "l2_mib": 96,
        "async_mma": False,
    },
    "B200": {
        "device_name": "NVIDIA B200",
        "memory_gib": 178.35,
        "memory_tech": "HBM3e",
        "hbm_tb_s": 8.0,
        "bf16_tflops": 2250,
        "fp8_tflops": 4500,
        "int8_tops": 4500,
        "interconnect_gb_s": 900,
        "sm_count": 148,
        "boost_clock_ghz": 1.965,
        "l2_mib": 126,
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
