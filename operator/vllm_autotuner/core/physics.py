"""The engine physics the tuner's model stands on: step times and KV capacity of one pod.

The prior comes from vllm-sim's catalog and roofline (`vllm_sim.steptime`, `vllm_sim.kv`):
weights, KV bytes per token and FLOPs of the deployment's model at its tensor-parallel size on
its GPU, and the KV cache vLLM would size for any knobs (weights, activation peak and CUDA
graphs taken off `gpu_memory_utilization`). Calibration moves two efficiencies (memory
bandwidth and compute) and a per-admission cost; those are fitted from what Prometheus shows
(perf_model.py), never hard-coded per deployment.

A model or GPU the catalog does not know falls back to the shape of Llama-3.1-8B on an H100
(the calibrated efficiencies then absorb the difference), and says so in `Physics.exact`.
"""

from __future__ import annotations

import math
from bisect import bisect_right
from dataclasses import dataclass, field
from functools import lru_cache

import numpy as np
import numpy.typing as npt

from vllm_sim.catalog import GPU_ALIASES, GPU_SPECS, GpuSpec, ModelSpec, load_gpu, load_model
from vllm_sim.kv import kv_cache_info, kv_dtype_bytes, resolve_config
from vllm_sim.steptime import StepTimeModel
from vllm_sim.types import EngineConfig, StartupError

FloatArray = npt.NDArray[np.float64]

FALLBACK_MODEL = "meta-llama/Llama-3.1-8B-Instruct"
FALLBACK_GPU = "H100"
# Token counts at which step time is evaluated exactly; in between it is interpolated.
_TOKEN_GRID = np.unique(
    np.concatenate([np.arange(0, 64, 8), np.geomspace(64, 65536, 48).round()]).astype(np.float64)
)


def sim_gpu_name(product: str | None) -> str | None:
    """The simulator's catalog name for a GPU product label, or None when it has none."""
    if not product:
        return None
    p = product.upper().replace("_", "-")
    for prefix in ("NVIDIA-", "TESLA-"):
        p = p.removeprefix(prefix)
    if p in GPU_SPECS:
        return p
    if p in GPU_ALIASES:
        return GPU_ALIASES[p]
    if p.startswith("A100"):
        return "A100-40GB" if "40G" in p else "A100-80GB"
    for key in sorted(GPU_SPECS, key=len, reverse=True):
        if p.startswith(key):
            return key
    return None


@dataclass(frozen=True)
class DeploymentShape:
    """What fixes the physics of one pod: model, GPU, TP, context length, KV dtype."""

    model: str
    gpu_product: str | None
    tensor_parallel_size: int = 1
    max_model_len: int | None = None
    kv_cache_dtype: str = "auto"
    enable_prefix_caching: bool = True


@dataclass(eq=False)
class Physics:
    """Step time and KV capacity of one pod of a deployment (prior efficiencies)."""

    shape: DeploymentShape
    model: ModelSpec
    gpu: GpuSpec
    gpu_name: str
    exact: bool  # False when the catalog knows the model or the GPU only by fallback
    kv_bytes_per_token: int
    _steps: dict[tuple[float, float], StepTimeModel] = field(default_factory=dict)

    @classmethod
    def of(cls, shape: DeploymentShape) -> Physics:
        return _physics(shape)

    # -- KV --------------------------------------------------------------------------------

    def config(self, mnbt: int, mns: int, gmu: float) -> EngineConfig:
        return EngineConfig(
            model=self.model.name,
            gpu=self.gpu_name,
            tensor_parallel_size=self.shape.tensor_parallel_size,
            max_num_seqs=int(mns),
            max_num_batched_tokens=int(mnbt),
            gpu_memory_utilization=float(gmu),
            max_model_len=self.shape.max_model_len,
            kv_cache_dtype=self.shape.kv_cache_dtype,
            enable_prefix_caching=self.shape.enable_prefix_caching,
        )

    def kv_tokens(self, mnbt: int, mns: int, gmu: float) -> float | None:
        """KV cache tokens vLLM would allocate with these knobs (None: it would not start)."""
        return _kv_tokens(self, int(mnbt), int(mns), round(float(gmu), 4))

    # -- step time ---------------------------------------------------------------------------

    def step_model(self, bandwidth: float, compute: float) -> StepTimeModel:
        key = (round(bandwidth, 4), round(compute, 4))
        m = self._steps.get(key)
        if m is None:
            if len(self._steps) > 256:
                self._steps.clear()
            m = StepTimeModel(
                self.model,
                self.gpu,
                self.shape.tensor_parallel_size,
                self.kv_bytes_per_token,
                bandwidth_efficiency=key[0],
                compute_efficiency=key[1],
            )
            self._steps[key] = m
        return m

    def step_curve(
        self, bandwidth: float, compute: float, n_seqs: float, ctx_per_seq: float
    ) -> StepCurveFn:
        """Step time as a function of the tokens of a step (`n_seqs` decodes of `ctx_per_seq`
        context each, plus prefill tokens): exact on a grid, linear in between, and never
        shorter for more tokens (the roofline dips by ~1e-5 where a first prefill sequence
        joins the decodes; a tuner that read the dip as a gain would chase noise)."""
        sm = self.step_model(bandwidth, compute)
        grid = _TOKEN_GRID + max(1.0, n_seqs)
        values = np.maximum.accumulate(_grid_step_times(sm, grid, n_seqs, ctx_per_seq))
        # The same steps with the prefill's attention left out, and what its pairs add: the
        # chord from none to PREFIX_PROBE pairs per prefill token (the roofline is linear in
        # pairs on either side of the corner where the step turns compute-bound).
        chunk = np.maximum(0.0, grid - n_seqs)
        none = _grid_step_times(sm, grid, n_seqs, ctx_per_seq, 0.0 * chunk)
        probe = np.maximum(1.0, chunk) * PREFIX_PROBE
        more = _grid_step_times(sm, grid, n_seqs, ctx_per_seq, probe)
        pair_s = np.maximum(0.0, (more - none) / probe)
        return StepCurveFn(grid, values, np.maximum.accumulate(none), pair_s)


# The far end of the chord that prices the prefill's attention: 8,192 query-key pairs per
# prefill token (the mean position in a 16k-token prompt). Past the corner where the step
# turns compute-bound the roofline is linear in pairs, so the chord is close to that slope;
# 1,024 gave the same longest gaps in test_steady_state's failing example, within 0.01 %.
PREFIX_PROBE = 8192.0


class StepCurveFn:
    """Step time over the tokens of a step, exact on a grid and linear in between (callable:
    a prompt's chunk attending to itself, chunk²/2 pairs), and the parts that let a caller
    count the prefill's attention itself: `without_prefill_attention(tokens) + pair_seconds
    (tokens) x pairs`. A prompt chunked past its start attends to its prefix in the KV cache
    as well (vLLM's chunked prefill), so a chunk of c tokens at offset o costs c x (o + c/2)
    pairs; prompts prefilled whole in one step attend only to themselves, P²/2 each."""

    def __init__(
        self, grid: FloatArray, values: FloatArray, none: FloatArray, pair_s: FloatArray
    ) -> None:
        self.grid = grid
        self.values = values
        self.none = none
        self.pair_s = pair_s
        self._grid_list: list[float] = grid.tolist()
        self._none_list: list[float] = none.tolist()
        self._pair_list: list[float] = pair_s.tolist()

    def step(self, tokens: float, pairs: float) -> float:
        """One step of `tokens` whose prefill attention covers `pairs` query-key pairs (plain
        floats: the mean-step iteration asks for a few dozen points at a time)."""
        g = self._grid_list
        i = bisect_right(g, tokens) - 1
        if i < 0:
            return self._none_list[0] + self._pair_list[0] * pairs
        if i >= len(g) - 1:
            return self._none_list[-1] + self._pair_list[-1] * pairs
        w = (tokens - g[i]) / (g[i + 1] - g[i])
        none, per = self._none_list, self._pair_list
        base = none[i] + (none[i + 1] - none[i]) * w
        return base + (per[i] + (per[i + 1] - per[i]) * w) * pairs

    def __call__(self, tokens: FloatArray) -> FloatArray:
        out: FloatArray = np.interp(tokens, self.grid, self.values)
        return out

    def without_prefill_attention(self, tokens: FloatArray) -> FloatArray:
        out: FloatArray = np.interp(tokens, self.grid, self.none)
        return out

    def pair_seconds(self, tokens: FloatArray) -> FloatArray:
        out: FloatArray = np.interp(tokens, self.grid, self.pair_s)
        return out


def _grid_step_times(
    sm: StepTimeModel,
    grid: FloatArray,
    n_seqs: float,
    ctx_per_seq: float,
    prefill_pairs: FloatArray | None = None,
) -> FloatArray:
    """`sm.step_time` at each token count of `grid` (whole tokens; one more sequence once a
    prefill chunk joins the decodes), in one array pass: the same operations in the same
    order on each element, so the same numbers as the per-point loop, five times faster."""
    seqs = max(1, round(n_seqs))
    ctx = max(0.0, n_seqs * ctx_per_seq)
    chunk = np.maximum(0.0, grid - n_seqs)
    # Attention query-key pairs: one query per decode against its context, and a prefill
    # chunk of `n - n_seqs` tokens against itself (causal: half the square).
    if prefill_pairs is None:
        prefill_pairs = 0.5 * chunk * chunk
    pairs = ctx + n_seqs + prefill_pairs
    n_seqs_at = seqs + (grid > n_seqs + 0.5).astype(np.float64)
    return sm.step_times(np.trunc(grid), n_seqs_at, np.full(grid.shape, ctx), pairs)


@lru_cache(maxsize=64)
def _physics(shape: DeploymentShape) -> Physics:
    exact = True
    try:
        model = load_model(shape.model)
    except (ValueError, OSError, KeyError):
        model, exact = load_model(FALLBACK_MODEL), False
    gpu_name = sim_gpu_name(shape.gpu_product)
    if gpu_name is None:
        gpu_name, exact = FALLBACK_GPU, False
    gpu = load_gpu(gpu_name)
    tp = max(1, shape.tensor_parallel_size)
    if model.num_attention_heads % tp:
        tp = 1
        exact = False
    kv_bytes = model.kv_bytes_per_token(tp, kv_dtype_bytes(shape.kv_cache_dtype, model))
    return Physics(
        shape=DeploymentShape(
            shape.model,
            shape.gpu_product,
            tp,
            shape.max_model_len,
            shape.kv_cache_dtype,
            shape.enable_prefix_caching,
        ),
        model=model,
        gpu=gpu,
        gpu_name=gpu_name,
        exact=exact,
        kv_bytes_per_token=int(kv_bytes),
    )


@lru_cache(maxsize=4096)
def _kv_tokens(phys: Physics, mnbt: int, mns: int, gmu: float) -> float | None:
    try:
        cfg = resolve_config(phys.config(mnbt, mns, gmu), phys.model, phys.gpu)
        info = kv_cache_info(cfg, phys.model, phys.gpu)
    except (StartupError, ValueError):
        return None
    return float(info.num_gpu_blocks * info.block_size)


def lognormal_sigma(mean: float, p90: float) -> float:
    """Sigma of a lognormal with this mean and p90 (p90 = mean * exp(1.2816 s - s^2 / 2))."""
    ratio = max(1.0001, p90 / max(mean, 1.0))
    disc = 1.2816**2 - 2.0 * math.log(ratio)
    if disc <= 0:
        return 1.2816
    return max(0.05, 1.2816 - math.sqrt(disc))
