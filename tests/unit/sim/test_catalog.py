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
}


@pytest.mark.parametrize("name", sorted(PUBLISHED_PARAMS_B))
def test_parameter_count_matches_the_published_size(name: str) -> None:
    model = load_model(name)
    # Qwen's q/k/v biases are not counted: they are a few million parameters.
    assert model.total_params / 1e9 == pytest.approx(PUBLISHED_PARAMS_B[name], rel=0.015)


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
