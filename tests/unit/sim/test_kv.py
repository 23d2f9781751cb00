"""Knob defaults, validation, KV sizing and vLLM's start-up failures (vLLM arg_utils.py,
gpu_worker.py, config/vllm.py)."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest

from vllm_sim.catalog import load_gpu
from vllm_sim.engine import Engine
from vllm_sim.kv import cudagraph_capture_sizes, engine_model, kv_cache_info, resolve_config
from vllm_sim.types import EngineConfig, StartupError

L8 = "meta-llama/Llama-3.1-8B-Instruct"


def info(cfg: EngineConfig):  # type: ignore[no-untyped-def]
    model, gpu = engine_model(cfg), load_gpu(cfg.gpu)
    resolved = resolve_config(cfg, model, gpu)
    return resolved, kv_cache_info(resolved, model, gpu)


# vLLM arg_utils.py, API-server tier.
@pytest.mark.parametrize(
    ("gpu", "mnbt", "mns"),
    [
        ("H100", 8192, 1024),
        ("H200", 8192, 1024),
        ("B200", 16384, 1024),
        ("A100-80GB", 2048, 256),
        ("A100-40GB", 2048, 256),
        ("L40S", 2048, 256),
    ],
)
def test_default_batch_knobs_per_gpu(gpu: str, mnbt: int, mns: int) -> None:
    resolved, _ = info(EngineConfig(model=L8, gpu=gpu, max_model_len=8192))
    assert (resolved.max_num_batched_tokens, resolved.max_num_seqs) == (mnbt, mns)


def test_max_model_len_defaults_to_the_models_context() -> None:
    resolved, _ = info(EngineConfig(model="meta-llama/Llama-2-7b-hf"))
    assert resolved.max_model_len == 4096


def test_post_processing_caps_tokens_by_seqs_times_len_and_seqs_by_tokens() -> None:
    # step 5: mnbt = min(max_num_seqs * max_model_len, mnbt) when mnbt was not set
    resolved, _ = info(EngineConfig(model=L8, max_num_seqs=2, max_model_len=1024))
    assert resolved.max_num_batched_tokens == 2048
    # step 6: max_num_seqs = min(max_num_seqs, mnbt) when max_num_seqs was not set
    resolved, _ = info(EngineConfig(model=L8, max_num_batched_tokens=512, max_model_len=4096))
    assert resolved.max_num_seqs == 512
    # neither applies to values the user set
    resolved, _ = info(EngineConfig(model=L8, max_num_seqs=4, max_num_batched_tokens=16384,
                                    max_model_len=1024))  # fmt: skip
    assert resolved.max_num_batched_tokens == 16384


def test_validation_like_scheduler_config() -> None:
    with pytest.raises(StartupError, match=r"max_num_batched_tokens \(64\) must be greater than "
                       r"or equal to max_num_seqs \(128\)"):  # fmt: skip
        info(EngineConfig(model=L8, max_num_batched_tokens=64, max_num_seqs=128))
    with pytest.raises(StartupError, match="is smaller than max_model_len"):
        info(EngineConfig(model=L8, max_num_batched_tokens=2048, max_model_len=4096,
                          enable_chunked_prefill=False))  # fmt: skip
    with pytest.raises(StartupError, match="long_prefill_token_threshold"):
        info(EngineConfig(model=L8, max_model_len=4096, long_prefill_token_threshold=5000))
    with pytest.raises(StartupError, match="greater than the derived max_model_len"):
        info(EngineConfig(model="meta-llama/Llama-2-7b-hf", max_model_len=8192))


def test_chunked_prefill_off_raises_the_default_budget_to_max_model_len() -> None:
    resolved, _ = info(EngineConfig(model=L8, gpu="A100-80GB", max_model_len=8192,
                                    enable_chunked_prefill=False))  # fmt: skip
    assert resolved.max_num_batched_tokens == 8192


def test_utilization_above_what_is_free_fails_like_vllm() -> None:
    with pytest.raises(StartupError, match=r"^Free memory on device cuda:0 .* is less than "
                       "desired GPU memory utilization"):  # fmt: skip
        info(EngineConfig(model=L8, gpu_memory_utilization=0.999, max_model_len=4096))
    info(EngineConfig(model=L8, gpu_memory_utilization=0.98, max_model_len=4096))


def test_no_memory_for_cache_blocks() -> None:
    # Llama-2-70B at TP2 holds ~64 GiB of weights per GPU: 80% of an H100 is not enough.
    with pytest.raises(StartupError, match=r"^No available memory for the cache blocks\. Try "
                       "increasing `gpu_memory_utilization`"):  # fmt: skip
        info(EngineConfig(model="meta-llama/Llama-2-70b-hf", tensor_parallel_size=2,
                          gpu_memory_utilization=0.8))  # fmt: skip


def test_one_max_len_request_must_fit() -> None:
    with pytest.raises(StartupError) as exc:
        info(EngineConfig(model=L8, gpu="L40S", gpu_memory_utilization=0.5))
    msg = str(exc.value)
    assert msg.startswith("To serve at least one request with the model's max seq len (131072)")
    estimated = int(msg.split("estimated maximum model length is ")[1].split(".")[0])
    assert 0 < estimated < 131072


def test_weights_that_cannot_load_are_a_cuda_oom() -> None:
    with pytest.raises(StartupError, match="CUDA out of memory"):
        info(EngineConfig(model="meta-llama/Llama-3.1-70B-Instruct", max_model_len=4096))


def test_kv_blocks_match_the_logged_real_run() -> None:
    # An inference-sim logged run: Llama-2-7B, H100, TP1, util 0.90, mbt 2048, mns 128 -> 7462.
    _, kv = info(EngineConfig(model="meta-llama/Llama-2-7b-hf", gpu_memory_utilization=0.90,
                              max_num_batched_tokens=2048, max_num_seqs=128))  # fmt: skip
    assert kv.num_gpu_blocks == pytest.approx(7462, rel=0.03)
    assert kv.kv_bytes_per_token == 2 * 32 * 32 * 128 * 2


def test_fp8_kv_doubles_capacity() -> None:
    base = EngineConfig(model=L8, max_model_len=8192)
    _, bf16 = info(base)
    _, fp8 = info(dataclasses.replace(base, kv_cache_dtype="fp8"))
    assert fp8.kv_bytes_per_token * 2 == bf16.kv_bytes_per_token
    assert fp8.num_gpu_blocks / bf16.num_gpu_blocks == pytest.approx(2.0, rel=0.02)


def test_knobs_move_capacity_the_physical_way() -> None:
    base = EngineConfig(model=L8, max_model_len=8192, max_num_seqs=256, max_num_batched_tokens=2048)
    _, kv = info(base)
    _, more_util = info(dataclasses.replace(base, gpu_memory_utilization=0.95))
    per_block = kv.kv_bytes_per_token * kv.block_size
    gained = (more_util.requested_memory_bytes - kv.requested_memory_bytes) / per_block
    assert more_util.num_gpu_blocks - kv.num_gpu_blocks == pytest.approx(gained, abs=1)
    _, big_budget = info(dataclasses.replace(base, max_num_batched_tokens=16384))
    assert big_budget.num_gpu_blocks < kv.num_gpu_blocks  # bigger activation peak
    _, many_seqs = info(dataclasses.replace(base, max_num_seqs=1024))
    assert many_seqs.num_gpu_blocks < kv.num_gpu_blocks  # more CUDA graphs, bigger sampler
    _, tp2 = info(dataclasses.replace(base, tensor_parallel_size=2))
    assert tp2.num_gpu_blocks > 2 * kv.num_gpu_blocks  # half the weights and half the heads
    assert kv.kv_cache_size_tokens == int(kv.max_concurrency * 8192)
    assert kv.kv_cache_size_tokens <= kv.num_gpu_blocks * kv.block_size


def test_capture_sizes_follow_the_default_rule() -> None:
    sizes = cudagraph_capture_sizes(1024, 8192, sm100=False)
    assert len(sizes) == 51 and sizes[:4] == [1, 2, 4, 8] and sizes[-1] == 512  # config/vllm.py
    small = cudagraph_capture_sizes(100, 2048, sm100=False)
    assert max(small) == 200 and 100 in small
    assert max(cudagraph_capture_sizes(1024, 8192, sm100=True)) == 1024


def test_block_override_is_used_but_must_hold_one_full_request() -> None:
    _, kv = info(EngineConfig(model=L8, max_model_len=1024, num_gpu_blocks_override=100))
    assert kv.num_gpu_blocks == 100
    with pytest.raises(StartupError, match="To serve at least one request"):
        info(EngineConfig(model=L8, max_model_len=1024, num_gpu_blocks_override=60))


def test_fp8_weights_free_memory_for_kv_and_keep_a_bf16_cache() -> None:
    base = EngineConfig(model=L8, max_model_len=8192, gpu_memory_utilization=0.9)
    _, bf16 = info(base)
    _, fp8 = info(dataclasses.replace(base, quantization="fp8"))
    assert fp8.kv_dtype_bytes == 2  # --kv-cache-dtype auto follows the activations, not weights
    freed = bf16.weights_bytes - fp8.weights_bytes
    assert freed / 1e9 == pytest.approx(6.98, rel=0.02)  # the linear layers, 2 -> 1 byte
    per_block = fp8.kv_bytes_per_token * fp8.block_size
    assert fp8.num_gpu_blocks - bf16.num_gpu_blocks == pytest.approx(freed / per_block, abs=2)


def test_a_quantization_flag_that_contradicts_the_checkpoint_fails_like_vllm(
    tmp_path: Path,
) -> None:
    awq = {"quant_method": "awq", "bits": 4, "group_size": 128}
    cfg = {"hidden_size": 4096, "num_hidden_layers": 32, "num_attention_heads": 32,
           "num_key_value_heads": 8, "intermediate_size": 14336, "vocab_size": 128256,
           "quantization_config": awq}  # fmt: skip
    path = tmp_path / "config.json"
    path.write_text(json.dumps(cfg))
    with pytest.raises(StartupError, match="does not match the quantization method"):
        Engine(EngineConfig(model=str(path), max_model_len=4096, quantization="fp8"))
    with pytest.raises(StartupError, match="can only quantize an unquantized checkpoint to fp8"):
        Engine(EngineConfig(model=L8, max_model_len=4096, quantization="awq"))


def test_llama4_scout_fp8_starts_on_two_h100s_with_room_for_kv(tmp_path: Path) -> None:
    from tests.unit.sim.test_catalog import SCOUT_FP8

    path = tmp_path / "config.json"
    path.write_text(json.dumps(SCOUT_FP8))
    cfg = EngineConfig(model=str(path), tensor_parallel_size=2, max_model_len=4096,
                       gpu_memory_utilization=0.9, max_num_seqs=128,
                       max_num_batched_tokens=2048)  # fmt: skip
    _, kv = info(cfg)
    assert kv.weights_bytes / 1e9 == pytest.approx(110.8 / 2, rel=0.01)
    assert kv.kv_bytes_per_token == 2 * 48 * 4 * 128 * 2  # BF16 cache, 4 KV heads per rank
    # 71.3 GiB budget - 55.7 GB of weights - ~1.5 GB of activations, graphs and buffers:
    # ~19 GB of KV per GPU, about 196k tokens
    assert 180_000 < kv.kv_cache_size_tokens < 210_000
    with pytest.raises(StartupError, match="CUDA out of memory"):
        info(dataclasses.replace(cfg, tensor_parallel_size=1))
