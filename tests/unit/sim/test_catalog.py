"""The catalog describes models and GPUs the way their owners do, and derives the physics."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from vllm_sim.catalog import gpu_names, load_gpu, load_model, model_names

# Published sizes (Hugging Face model cards), in billions.
PUBLISHED_PARAMS_B = {
    "meta-llama/Llama-3.1-8B-Instruct": 8.03,
    "meta-llama/Llama-3.1-70B-Instruct": 70.6,
    "Qwen/Qwen2.5-7B-Instruct": 7.62,
    "Qwen/Qwen2.5-32B-Instruct": 32.8,
    "mistralai/Mistral-7B-Instruct-v0.3": 7.25,
    "mistralai/Mixtral-8x7B-Instruct-v0.1": 46.7,
    "meta-llama/Llama-2-7b-hf": 6.74,
    "codellama/CodeLlama-34b-Instruct-hf": 33.7,
    "meta-llama/Llama-2-70b-hf": 69.0,
    "meta-llama/Llama-4-Scout-17B-16E-Instruct": 109.0,  # with its vision tower
}


@pytest.mark.parametrize("name", sorted(PUBLISHED_PARAMS_B))
def test_parameter_count_matches_the_published_size(name: str) -> None:
    model = load_model(name)
    # Qwen's q/k/v biases are not counted: they are a few million parameters.
    total = model.total_params + model.extra_params
    assert total / 1e9 == pytest.approx(PUBLISHED_PARAMS_B[name], rel=0.015)


def test_every_catalog_model_is_in_the_published_table() -> None:
    assert set(model_names()) == set(PUBLISHED_PARAMS_B)


def test_llama_31_8b_streams_15_gb_per_decode_step_and_128_kib_per_token() -> None:
    # From config.json: 6.98 B non-embedding params, 15.01 GB per step incl. lm_head.
    m = load_model("llama-3.1-8b-instruct")
    assert m.active_params_per_token / 1e9 == pytest.approx(6.98, abs=0.01)
    assert m.streamed_weight_bytes(1) / 1e9 == pytest.approx(15.01, abs=0.02)
    assert m.kv_bytes_per_token(tp=1, kv_dtype_bytes=2) == 131072  # vLLM kv_cache_interface.py


def test_mixtral_activates_two_of_eight_experts() -> None:
    m = load_model("mistralai/Mixtral-8x7B-v0.1")
    assert m.is_moe
    # ~12.9 B active parameters per token (Mistral's announcement), lm_head excluded here.
    assert m.active_params_per_token / 1e9 == pytest.approx(12.6, rel=0.02)
    # One token reads two experts per layer; a large batch reads all eight.
    one = m.streamed_weight_bytes(1)
    many = m.streamed_weight_bytes(4096)
    assert many / one == pytest.approx(
        m.total_params / (m.total_params - 6 * 32 * m.expert_params), rel=0.05
    )


def test_kv_heads_are_replicated_when_tp_exceeds_them() -> None:
    m = load_model("Qwen/Qwen2.5-7B-Instruct")  # 4 KV heads
    assert m.kv_heads_per_rank(8) == 1
    assert m.kv_bytes_per_token(8, 2) == m.kv_bytes_per_token(4, 2)
    assert m.kv_bytes_per_token(2, 2) == 2 * m.kv_bytes_per_token(4, 2)


def test_an_uncatalogued_model_loads_from_its_config_json(tmp_path: Path) -> None:
    cfg = {
        "hidden_size": 2048,
        "num_hidden_layers": 16,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "intermediate_size": 8192,
        "vocab_size": 128256,
        "max_position_embeddings": 131072,
        "tie_word_embeddings": True,
        "torch_dtype": "bfloat16",
    }  # Llama-3.2-1B's architecture
    path = tmp_path / "config.json"
    path.write_text(json.dumps(cfg))
    for ref in (str(path), str(tmp_path)):
        m = load_model(ref)
        assert m.head_dim == 64  # derived: hidden / heads
        assert m.lm_head_params == 0  # tied
        assert m.total_params / 1e9 == pytest.approx(1.24, rel=0.01)


def test_gpu_spec_from_file_and_catalog(tmp_path: Path) -> None:
    spec = {"memory_gib": 24, "hbm_tb_s": 0.3, "bf16_tflops": 121, "fp8_tflops": 242}
    path = tmp_path / "L4.json"
    path.write_text(json.dumps(spec))
    gpu = load_gpu(str(path))
    assert gpu.name == "L4"
    assert gpu.hbm_bandwidth == pytest.approx(0.3e12)
    assert set(gpu_names()) >= {"A100-40GB", "A100-80GB", "H100", "H200", "L40S", "B200"}
    h100 = load_gpu("h100")
    assert h100.bf16_flops == pytest.approx(989e12)  # dense, not the sparsity figure
    assert h100.hbm_bandwidth / 1e12 == pytest.approx(3.35)
    # SM counts feed the KV-tail term; a spec file may give its own
    assert (h100.sm_count, load_gpu("A100").sm_count, gpu.sm_count) == (132, 108, 132)
    path.write_text(json.dumps({**spec, "sm_count": 58}))
    assert load_gpu(str(path)).sm_count == 58


def test_unknown_names_are_refused() -> None:
    with pytest.raises(ValueError, match="unknown model"):
        load_model("no-such/model")
    with pytest.raises(ValueError, match="unknown GPU"):
        load_gpu("TPU-v9")


# Llama-4-Scout as RedHatAI/Llama-4-Scout-17B-16E-Instruct-FP8-dynamic publishes it: FP8 weights
# and activations (compressed-tensors), BF16 KV cache, routers, lm_head and vision tower left out.
SCOUT_FP8 = {
    "architectures": ["Llama4ForConditionalGeneration"],
    "torch_dtype": "bfloat16",
    "quantization_config": {
        "quant_method": "compressed-tensors",
        "config_groups": {
            "group_0": {
                "targets": ["Linear"],
                "weights": {"num_bits": 8, "type": "float", "strategy": "channel"},
                "input_activations": {"num_bits": 8, "type": "float", "dynamic": True,
                                      "strategy": "token"},
            }
        },
        "ignore": ["re:.*router", "re:.*vision_model.*", "re:.*multi_modal_projector.*",
                   "lm_head"],
    },
    "text_config": {
        "hidden_size": 5120, "num_hidden_layers": 48, "num_attention_heads": 40,
        "num_key_value_heads": 8, "head_dim": 128, "intermediate_size": 8192,
        "intermediate_size_mlp": 16384, "num_local_experts": 16, "num_experts_per_tok": 1,
        "interleave_moe_layer_step": 1, "vocab_size": 202048,
        "max_position_embeddings": 10485760, "tie_word_embeddings": False,
        "torch_dtype": "bfloat16",
    },
    "vision_config": {"hidden_size": 1408, "num_hidden_layers": 34, "intermediate_size": 5632,
                      "patch_size": 14, "projector_input_dim": 4096, "projector_output_dim": 4096},
}  # fmt: skip


def test_llama4_scout_fp8_reads_its_nested_text_config_and_shared_expert(tmp_path: Path) -> None:
    path = tmp_path / "config.json"
    path.write_text(json.dumps(SCOUT_FP8))
    fp8 = load_model(str(path))
    bf16 = load_model("meta-llama/Llama-4-Scout-17B-16E-Instruct")
    assert (fp8.num_hidden_layers, fp8.hidden_size, fp8.num_local_experts) == (48, 5120, 16)
    assert fp8.moe_layers == 48 and fp8.dense_layers == 0
    # one shared expert beside the one routed expert: 17B active with the lm_head
    assert fp8.shared_expert_params == fp8.expert_params == 3 * 5120 * 8192
    assert (fp8.active_params_per_token + fp8.lm_head_params) / 1e9 == pytest.approx(16.1, rel=0.02)
    assert fp8.quant.method == "compressed-tensors-w8a8-float" and fp8.quant.compute == "fp8"
    assert fp8.dtype_bytes == 2  # activations and, with kv-cache-dtype auto, the KV cache
    # weights memory: quantized linears at 1 byte, the rest (and the vision tower) at 2
    assert fp8.extra_params / 1e9 == pytest.approx(0.83, rel=0.02)
    assert fp8.weights_bytes / 1e9 == pytest.approx(110.8, rel=0.01)
    assert bf16.weights_bytes / 1e9 == pytest.approx(217.2, rel=0.01)
    # a decode step reads the attention, the shared expert and one routed expert per layer
    assert fp8.streamed_weight_bytes(1) / bf16.streamed_weight_bytes(1) == pytest.approx(
        0.53, abs=0.02
    )


@pytest.mark.parametrize(
    ("qc", "bits", "compute"),
    [
        ({"quant_method": "fp8", "activation_scheme": "dynamic"}, 8.0, "fp8"),
        ({"quant_method": "awq", "bits": 4, "group_size": 128}, 4.125, "bf16"),
        ({"quant_method": "gptq", "bits": 8, "group_size": -1}, 8.0, "bf16"),
        ({"quant_method": "compressed-tensors", "config_groups": {"g": {
            "weights": {"num_bits": 8, "type": "int"},
            "input_activations": {"num_bits": 8, "type": "int"}}}}, 8.0, "int8"),
        ({"quant_method": "compressed-tensors", "config_groups": {"g": {
            "weights": {"num_bits": 4, "type": "int", "group_size": 128}}}}, 4.125, "bf16"),
    ],
)  # fmt: skip
def test_weight_precisions_from_quantization_config(
    tmp_path: Path, qc: dict[str, object], bits: float, compute: str
) -> None:
    raw = {
        "hidden_size": 4096,
        "num_hidden_layers": 32,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "intermediate_size": 14336,
        "vocab_size": 128256,
        "quantization_config": qc,
    }  # fmt: skip  (Llama-3.1-8B's architecture)
    path = tmp_path / "config.json"
    path.write_text(json.dumps(raw))
    m = load_model(str(path))
    assert m.quant.weight_bits == pytest.approx(bits) and m.quant.compute == compute
    full = load_model("meta-llama/Llama-3.1-8B-Instruct")
    linear = full.linear_params_always_read
    saved = linear * (2 - bits / 8)
    assert m.weights_bytes == pytest.approx(full.weights_bytes - saved, rel=1e-6)


def test_an_unknown_quantization_method_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "config.json"
    path.write_text(json.dumps({"hidden_size": 64, "num_hidden_layers": 2,
                                "num_attention_heads": 2, "intermediate_size": 128,
                                "vocab_size": 100,
                                "quantization_config": {"quant_method": "magic"}}))  # fmt: skip
    with pytest.raises(ValueError, match="unsupported quant_method 'magic'"):
        load_model(str(path))


def test_shared_experts_and_dense_first_layers_of_other_families(tmp_path: Path) -> None:
    qwen_moe = {  # Qwen1.5-MoE-A2.7B's shape: 60 experts of 1408, top-4, a 5632 shared expert
        "hidden_size": 2048,
        "num_hidden_layers": 24,
        "num_attention_heads": 16,
        "num_key_value_heads": 16,
        "intermediate_size": 5632,
        "moe_intermediate_size": 1408,
        "shared_expert_intermediate_size": 5632,
        "num_experts": 60,
        "num_experts_per_tok": 4,
        "vocab_size": 151936,
    }
    deepseek = {  # DeepSeek-V2-Lite's MoE shape: first layer dense, 2 shared of 1408
        "hidden_size": 2048, "num_hidden_layers": 27, "num_attention_heads": 16,
        "num_key_value_heads": 16, "intermediate_size": 10944, "moe_intermediate_size": 1408,
        "n_shared_experts": 2, "n_routed_experts": 64, "num_experts_per_tok": 6,
        "first_k_dense_replace": 1, "vocab_size": 102400,
    }  # fmt: skip
    for cfg, shared, moe_layers in ((qwen_moe, 5632, 24), (deepseek, 2 * 1408, 26)):
        path = tmp_path / "config.json"
        path.write_text(json.dumps(cfg))
        m = load_model(str(path))
        assert m.shared_expert_intermediate_size == shared
        assert (m.moe_layers, m.dense_layers) == (moe_layers, 27 - 26 if moe_layers == 26 else 0)
        assert m.expert_params == 3 * 2048 * 1408
