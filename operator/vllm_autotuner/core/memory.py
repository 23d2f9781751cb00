"""What memory is proven safe: gpu_memory_utilization per token budget.

A pod's memory at run time grows with gpu_memory_utilization (the KV cache vLLM reserves) and
with max_num_batched_tokens (the activations and sampler buffers it profiles and allocates at
that budget; vLLM's `determine_available_memory` profiles a forward pass at the full budget
before sizing the KV cache). A configuration that served a whole verify window without a crash
proves the memory it used: every configuration it dominates (no more tokens, no more
utilization) is safe as well. The proofs are a Pareto frontier of (budget, utilization).

What a proof does not show is the other side of either axis. A utilization proven at 256
tokens says nothing about 2,368 tokens at the same utilization: on bench/tuning's
kv-bound-8b-a100-40gb (traffic seed 205) that rollout passed its canary and crashed after
promotion. So a proof at budget t reaches budgets up to `TOKEN_REACH` times t, and beyond every
proof's reach only the utilization proven at the largest budget is known safe.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .tuning_types import Knobs

# Knobs closer than this in gpu_memory_utilization are the same configuration (tuning_types
# re-exports it; it lives here so that the frontier needs nothing from there at run time).
GMU_EPSILON = 1e-6

TOKEN_REACH = 2.0
"""A proof at a token budget covers budgets up to this multiple of it. Doubling the budget at
most doubles the activation memory vLLM profiles at it, a few hundred MiB for an 8B model at
2,048 tokens: the same order as one `gmuRiseStep` (0.02 of 40 GiB is 820 MiB)."""

MAX_PROOFS = 8
"""Points kept on the frontier (status stays small; the frontier rarely has more than 3)."""


@dataclass(frozen=True)
class ProvenMemory:
    """The Pareto frontier of (max_num_batched_tokens, gpu_memory_utilization) proven stable,
    by budget ascending (and so by utilization descending)."""

    points: tuple[tuple[int, float], ...] = ()

    @classmethod
    def of(cls, points: Iterable[tuple[int, float]]) -> ProvenMemory:
        """The frontier of `points`: dominated points go, ties keep one."""
        frontier: list[tuple[int, float]] = []
        # Largest budget first; a point stays only when its utilization beats every point with
        # at least its budget.
        for tokens, gmu in sorted(points, key=lambda p: (-p[0], -p[1])):
            if not frontier or gmu > frontier[-1][1] + GMU_EPSILON:
                frontier.append((int(tokens), float(gmu)))
        kept = sorted(frontier)
        if len(kept) > MAX_PROOFS:
            # Keep both ends (the largest budget is the floor, the highest utilization the
            # ceiling) and the points nearest them.
            kept = kept[: MAX_PROOFS // 2] + kept[-(MAX_PROOFS - MAX_PROOFS // 2) :]
        return cls(tuple(kept))

    def with_proof(self, knobs: Knobs) -> ProvenMemory:
        """The frontier once `knobs` served a whole window without a crash."""
        return ProvenMemory.of(
            (*self.points, (knobs.max_num_batched_tokens, knobs.gpu_memory_utilization))
        )

    def without_claims_on(self, knobs: Knobs) -> ProvenMemory:
        """The frontier after `knobs` OOM-ed: every proof that claimed it safe was wrong."""
        return ProvenMemory.of(p for p in self.points if not _dominates(p, knobs))

    def at(self, tokens: int) -> float:
        """The highest utilization proven safe at this budget (0 with no proof at all)."""
        reach = [g for t, g in self.points if tokens <= TOKEN_REACH * t + 1e-9]
        if reach:
            return max(reach)
        return self.points[-1][1] if self.points else 0.0

    def highest(self) -> float:
        """The highest utilization proven at any budget (0 with no proof at all)."""
        return max((g for _, g in self.points), default=0.0)

    def covers(self, knobs: Knobs) -> bool:
        """Some proof dominates `knobs`: running it is no memory experiment."""
        return any(_dominates(p, knobs) for p in self.points)

    def to_list(self) -> list[dict[str, Any]]:
        return [{"maxNumBatchedTokens": t, "gpuMemoryUtilization": g} for t, g in self.points]

    @classmethod
    def from_list(cls, items: Sequence[Mapping[str, Any]]) -> ProvenMemory:
        return cls.of(
            (int(i["maxNumBatchedTokens"]), float(i["gpuMemoryUtilization"])) for i in items
        )


def _dominates(point: tuple[int, float], knobs: Knobs) -> bool:
    tokens, gmu = point
    return (
        tokens >= knobs.max_num_batched_tokens and gmu >= knobs.gpu_memory_utilization - GMU_EPSILON
    )
