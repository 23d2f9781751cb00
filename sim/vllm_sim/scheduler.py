"""vLLM V1's scheduler and paged KV cache, one engine step at a time (vllm.md §4).

The running set is held as numpy arrays in admission order, so a step over hundreds of running
requests costs a handful of vector operations instead of a Python loop per request; the rare
steps in which KV allocation fails fall back to a sequential loop that follows vLLM's preemption
order exactly. Blocks are accounted by count; only blocks that prefix caching can reuse carry a
hash (shared-prefix blocks, and the full blocks of a preempted request, which its recompute can
hit).
"""

from __future__ import annotations

from collections import OrderedDict, deque
from dataclasses import dataclass, field

import numpy as np
import numpy.typing as npt

from vllm_sim.types import EngineConfig, Request

IntArray = npt.NDArray[np.int64]
FloatArray = npt.NDArray[np.float64]
BlockHash = tuple[str, str, int]


def _empty_i() -> IntArray:
    return np.zeros(0, dtype=np.int64)


class BlockPool:
    """Free blocks (uncached, or cached and evictable in LRU order) and referenced cached blocks.

    Allocation takes uncached free blocks first, then evicts the least recently freed cached
    block. (vLLM keeps one LRU queue for both; preferring uncached blocks keeps cached prefixes
    a little longer, which only matters once the cache is full of evictable blocks.)
    """

    def __init__(self, num_gpu_blocks: int) -> None:
        self.num_gpu_blocks = num_gpu_blocks
        self.free_uncached = num_gpu_blocks - 1  # one permanent null block
        self.evictable: OrderedDict[BlockHash, None] = OrderedDict()
        self.refs: dict[BlockHash, int] = {}

    def num_free(self) -> int:
        return self.free_uncached + len(self.evictable)

    def num_used(self) -> int:
        return self.num_gpu_blocks - 1 - self.num_free()

    def usage(self) -> float:
        """vllm:kv_cache_usage_perc: 1 - free/(num_gpu_blocks - 1)."""
        return 1.0 - self.num_free() / (self.num_gpu_blocks - 1)

    def take(self, n: int) -> None:
        if n <= self.free_uncached:
            self.free_uncached -= n
            return
        n -= self.free_uncached
        self.free_uncached = 0
        for _ in range(n):
            self.evictable.popitem(last=False)

    def has(self, h: BlockHash) -> bool:
        return h in self.refs or h in self.evictable

    def acquire(self, h: BlockHash) -> None:
        if h in self.refs:
            self.refs[h] += 1
        else:
            del self.evictable[h]
            self.refs[h] = 1

    def register(self, h: BlockHash) -> bool:
        """Turn a freshly computed private block into a cached one; False if already cached."""
        if self.has(h):
            return False
        self.refs[h] = 1
        return True

    def release(self, h: BlockHash) -> None:
        n = self.refs[h] - 1
        if n:
            self.refs[h] = n
        else:
            del self.refs[h]
            self.evictable[h] = None

    def park(self, h: BlockHash) -> bool:
        """A private full block is freed but stays hit-able; False if its hash is already cached."""
        if self.has(h):
            return False
        self.evictable[h] = None
        return True


class Seq:
    """One request inside the engine. Array-held fields are authoritative only while waiting."""

    __slots__ = (
        "arrival",
        "cached_tokens",
        "comp",
        "first_scheduled",
        "first_token_time",
        "held",
        "last_step",
        "last_time",
        "lim",
        "max_tokens",
        "n_prefix_blocks",
        "ntok",
        "num_preemptions",
        "pid",
        "plen",
        "queried",
        "req",
        "rid",
        "runs",
        "shared",
    )

    def __init__(self, req: Request, max_model_len: int, block_size: int, arrival: float) -> None:
        self.req = req
        self.rid = req.request_id
        self.arrival = arrival
        self.plen = req.prompt_len
        self.max_tokens = req.max_tokens
        self.lim = min(req.prompt_len + req.max_tokens, max_model_len)
        self.pid = req.prefix_id
        self.n_prefix_blocks = (
            min(req.prefix_len, req.prompt_len) // block_size if req.prefix_id else 0
        )
        self.ntok = req.prompt_len
        self.comp = 0
        self.held = 0
        self.shared: list[BlockHash] = []
        self.first_scheduled: float | None = None
        self.first_token_time: float | None = None
        self.cached_tokens = 0
        self.num_preemptions = 0
        self.queried = False
        self.last_step = -2
        self.last_time = float("nan")
        self.runs: list[int] = []  # [start, end, start, end, ...] of the steps that made tokens

    def block_hash(self, i: int) -> BlockHash:
        if i < self.n_prefix_blocks:
            assert self.pid is not None
            return ("p", self.pid, i)
        return ("r", self.rid, i)

    @property
    def output_len(self) -> int:
        return self.ntok - self.plen


@dataclass
class Batch:
    """What one step schedules (the inputs of the step-time model and of `commit`)."""

    n_tokens: int
    n_seqs: int
    ctx_tokens: int
    attn_pairs: float
    admitted: list[Seq]
    hits: list[int]  # prefix-cache hit tokens of each admitted request
    preempted: list[Seq]
    sched: IntArray = field(default_factory=_empty_i)


@dataclass
class StepOutcome:
    """What one step produced, for the engine's records and metrics."""

    n_generated: int
    itl_gaps: FloatArray
    first_tokens: list[Seq]
    finished: list[Seq]
    token_seqs: list[Seq]  # only filled when asked for (streaming)
    token_index: list[int]


class Scheduler:
    """The V1 scheduling policy over a paged KV cache (FCFS, recompute preemption)."""

    def __init__(self, cfg: EngineConfig, num_gpu_blocks: int, record_itl: bool = True) -> None:
        assert cfg.max_num_seqs is not None and cfg.max_num_batched_tokens is not None
        assert cfg.max_model_len is not None
        self.bs = cfg.block_size
        self.mns = cfg.max_num_seqs
        self.budget = cfg.max_num_batched_tokens
        self.mml = cfg.max_model_len
        self.thr = cfg.long_prefill_token_threshold
        self.caching = cfg.enable_prefix_caching
        self.chunked = cfg.enable_chunked_prefill
        self.record_itl = record_itl
        self.pool = BlockPool(num_gpu_blocks)
        self.running: list[Seq] = []
        self.waiting: deque[Seq] = deque()
        self.comp = _empty_i()
        self.ntok = _empty_i()
        self.lim = _empty_i()
        self.held = _empty_i()
        self.plen = _empty_i()
        self.last_step = _empty_i()
        self.last_t = np.zeros(0, dtype=np.float64)
        self.step_index = 0
        self._times = np.zeros(1024, dtype=np.float64)  # end time of every step, by index
        self.total_preemptions = 0

    # ---- bookkeeping helpers -------------------------------------------------------------

    def step_end_time(self, s: int) -> float:
        return float(self._times[s])

    def _record_time(self, s: int, t: float) -> None:
        if s >= self._times.size:
            self._times = np.concatenate([self._times, np.zeros(self._times.size)])
        self._times[s] = t

    def _record_times(self, s0: int, ts: FloatArray) -> None:
        while s0 + ts.size > self._times.size:
            self._times = np.concatenate([self._times, np.zeros(self._times.size)])
        self._times[s0 : s0 + ts.size] = ts

    def private_blocks_running(self) -> int:
        """Blocks held by running requests and not shared through the cache (for invariants)."""
        return int(self.held.sum()) - sum(len(s.shared) for s in self.running)

    def token_times(self, seq: Seq) -> FloatArray:
        """Times of a request's tokens, rebuilt from its runs of consecutive steps."""
        runs = [*seq.runs, seq.last_step] if len(seq.runs) % 2 else seq.runs
        idx = np.concatenate(
            [np.arange(runs[i], runs[i + 1] + 1) for i in range(0, len(runs), 2)]
        ) if runs else _empty_i()  # fmt: skip
        out: FloatArray = self._times[idx]
        return out

    # ---- admission helpers ---------------------------------------------------------------

    def _lookup_hits(self, seq: Seq) -> tuple[list[BlockHash], int]:
        """Longest run of cached full blocks (at least the last token is recomputed)."""
        if not self.caching:
            return [], 0
        hits: list[BlockHash] = []
        evictable = 0
        pool = self.pool
        for i in range((seq.ntok - 1) // self.bs):
            h = seq.block_hash(i)
            if h in pool.refs:
                hits.append(h)
            elif h in pool.evictable:
                hits.append(h)
                evictable += 1
            else:
                break
        return hits, evictable

    def head_admissible(self) -> bool:
        """Whether step 2 could admit the waiting head right now (budget and seats permitting)."""
        if not self.waiting or len(self.running) >= self.mns:
            return False
        seq = self.waiting[0]
        hits, evictable = self._lookup_hits(seq)
        need = -(-seq.ntok // self.bs) - len(hits)
        return need <= self.pool.num_free() - evictable

    # ---- one step ------------------------------------------------------------------------

    def schedule(self, now: float) -> Batch:
        bs = self.bs
        budget = self.budget
        thr = self.thr if (self.thr > 0 and len(self.running) + len(self.waiting) > 1) else 0
        preempted: list[Seq] = []
        if self.running:
            want = self.ntok - self.comp
            if thr:
                want = np.minimum(want, thr)
            if int(want.sum()) <= budget:
                sched = want
            else:
                before = np.cumsum(want) - want
                sched = np.minimum(want, np.maximum(budget - before, 0))
            need = (self.comp + sched + (bs - 1)) // bs - self.held
            total_need = int(need.sum())
            if total_need <= self.pool.num_free():
                self.pool.take(total_need)
                self.held = self.held + need
            else:
                sched = self._schedule_running_sequential(want, preempted)
            budget_left = budget - int(sched.sum())
        else:
            sched = _empty_i()
            budget_left = budget

        admitted: list[Seq] = []
        hits_tokens: list[int] = []
        chunks: list[int] = []
        if not preempted:
            pool = self.pool
            while budget_left > 0 and self.waiting and len(self.running) + len(admitted) < self.mns:
                seq = self.waiting[0]
                hits, evictable = self._lookup_hits(seq)
                nhit = len(hits)
                total_blocks = -(-seq.ntok // bs)
                # scheduler_reserve_full_isl: the whole sequence must fit, not just the chunk.
                if total_blocks - nhit > pool.num_free() - evictable:
                    break
                comp0 = nhit * bs
                num_new = seq.ntok - comp0
                if thr:
                    num_new = min(num_new, thr)
                if not self.chunked and num_new > budget_left:
                    break
                num_new = min(num_new, budget_left)
                for h in hits:
                    pool.acquire(h)
                new_blocks = -(-(comp0 + num_new) // bs) - nhit
                pool.take(new_blocks)
                self.waiting.popleft()
                seq.shared = hits
                seq.comp = comp0
                seq.held = nhit + new_blocks
                if seq.first_scheduled is None:
                    seq.first_scheduled = now
                admitted.append(seq)
                hits_tokens.append(comp0)
                chunks.append(num_new)
                budget_left -= num_new
        if admitted:
            self._append_running(admitted)
            sched = np.concatenate([sched, np.asarray(chunks, dtype=np.int64)])
        n_tokens = int(sched.sum())
        active = sched > 0
        n_seqs = int(np.count_nonzero(active))
        ctx = int(np.dot(self.comp, active))
        pairs = float(np.dot(sched, self.comp)) + (float(np.dot(sched, sched)) + n_tokens) / 2.0
        return Batch(n_tokens, n_seqs, ctx, pairs, admitted, hits_tokens, preempted, sched)

    def _append_running(self, seqs: list[Seq]) -> None:
        self.running.extend(seqs)

        def col(attr: str) -> IntArray:
            return np.fromiter((getattr(s, attr) for s in seqs), dtype=np.int64, count=len(seqs))

        self.comp = np.concatenate([self.comp, col("comp")])
        self.ntok = np.concatenate([self.ntok, col("ntok")])
        self.lim = np.concatenate([self.lim, col("lim")])
        self.held = np.concatenate([self.held, col("held")])
        self.plen = np.concatenate([self.plen, col("plen")])
        self.last_step = np.concatenate([self.last_step, col("last_step")])
        lt = np.fromiter((s.last_time for s in seqs), dtype=np.float64, count=len(seqs))
        self.last_t = np.concatenate([self.last_t, lt])

    def _sync_out(self, j: int, seq: Seq) -> None:
        seq.comp = int(self.comp[j])
        seq.ntok = int(self.ntok[j])
        seq.held = int(self.held[j])
        seq.last_step = int(self.last_step[j])
        seq.last_time = float(self.last_t[j])

    def _remove(self, idx: list[int]) -> None:
        for j in sorted(idx, reverse=True):
            del self.running[j]
        self.comp = np.delete(self.comp, idx)
        self.ntok = np.delete(self.ntok, idx)
        self.lim = np.delete(self.lim, idx)
        self.held = np.delete(self.held, idx)
        self.plen = np.delete(self.plen, idx)
        self.last_step = np.delete(self.last_step, idx)
        self.last_t = np.delete(self.last_t, idx)

    def _free_blocks(self, seq: Seq, keep_hashes: bool) -> None:
        """Return a request's blocks; a preempted one leaves its full blocks hit-able."""
        pool = self.pool
        for h in seq.shared:
            pool.release(h)
        private = seq.held - len(seq.shared)
        if keep_hashes and self.caching:
            for i in range(len(seq.shared), min(seq.comp // self.bs, seq.held)):
                if pool.park(seq.block_hash(i)):
                    private -= 1
        pool.free_uncached += private
        seq.shared = []
        seq.held = 0

    def _preempt_last(self) -> Seq:
        """Recompute preemption of the most recently admitted running request."""
        j = len(self.running) - 1
        seq = self.running[j]
        self._sync_out(j, seq)
        self._free_blocks(seq, keep_hashes=True)
        seq.comp = 0
        seq.num_preemptions += 1
        self.total_preemptions += 1
        self._remove([j])
        self.waiting.appendleft(seq)
        return seq

    def _schedule_running_sequential(self, want: IntArray, preempted: list[Seq]) -> IntArray:
        """Step 1 request by request, preempting from the tail when blocks run out."""
        bs = self.bs
        sched = np.zeros(len(self.running), dtype=np.int64)
        budget_left = self.budget
        i = 0
        while i < len(self.running) and budget_left > 0:
            n = min(int(want[i]), budget_left)
            need = -(-(int(self.comp[i]) + n) // bs) - int(self.held[i])
            self_preempted = False
            while need > self.pool.num_free():
                victim = len(self.running) - 1
                preempted.append(self._preempt_last())
                want = want[:victim]
                sched = sched[:victim]
                if victim == i:
                    self_preempted = True
                    break
            if self_preempted:
                break
            self.pool.take(need)
            self.held[i] += need
            sched[i] = n
            budget_left -= n
            i += 1
        return sched

    def commit(self, batch: Batch, t_end: float, want_tokens: bool = False) -> StepOutcome:
        """Apply a scheduled step that ends at `t_end`: tokens, prefix blocks, finishes."""
        s = self.step_index
        self.step_index += 1
        self._record_time(s, t_end)
        sched = batch.sched
        if sched.size == 0:
            return StepOutcome(0, np.zeros(0), [], [], [], [])
        self.comp = self.comp + sched
        if self.caching:
            self._register_prefix_blocks(np.flatnonzero(sched > 1))
        produced = np.flatnonzero((self.comp == self.ntok) & (sched > 0))
        first_tokens: list[Seq] = []
        finished: list[Seq] = []
        token_seqs: list[Seq] = []
        token_index: list[int] = []
        gaps: FloatArray = np.zeros(0)
        if produced.size:
            out_before = self.ntok[produced] - self.plen[produced]
            is_first = out_before == 0
            later = produced[~is_first]
            gaps = t_end - self.last_t[later]
            if self.record_itl:
                for j in later[self.last_step[later] != s - 1].tolist():
                    seq = self.running[j]
                    seq.runs.append(int(self.last_step[j]))
                    seq.runs.append(s)
            for j in produced[is_first].tolist():
                seq = self.running[j]
                seq.first_token_time = t_end
                seq.runs = [s]
                first_tokens.append(seq)
            if want_tokens:
                for j, o in zip(produced.tolist(), out_before.tolist(), strict=True):
                    token_seqs.append(self.running[j])
                    token_index.append(o)
            self.ntok[produced] += 1
            self.last_t[produced] = t_end
            self.last_step[produced] = s
            done = produced[self.ntok[produced] >= self.lim[produced]].tolist()
            if done:
                for j in done:
                    seq = self.running[j]
                    self._sync_out(j, seq)
                    self._free_blocks(seq, keep_hashes=False)
                    finished.append(seq)
                self._remove(done)
        return StepOutcome(
            int(produced.size), gaps, first_tokens, finished, token_seqs, token_index
        )

    def _register_prefix_blocks(self, idx: IntArray) -> None:
        for j in idx.tolist():
            seq = self.running[j]
            n_full = min(int(self.comp[j]) // self.bs, seq.n_prefix_blocks)
            while len(seq.shared) < n_full:
                h = seq.block_hash(len(seq.shared))
                if not self.pool.register(h):
                    seq.n_prefix_blocks = len(seq.shared)  # someone else cached it first
                    break
                seq.shared.append(h)

    # ---- skip-ahead over pure-decode stretches -----------------------------------------------

    def decode_stretch_limit(self) -> int:
        """How many pure-decode steps can run before anything but decoding happens.

        0 unless every running request is decoding and the waiting head cannot be admitted.
        The bound stops one step before the first finish, and where the blocks the stretch
        allocates would exceed the free ones (so no preemption can happen inside it).
        """
        if not self.running or len(self.running) > self.budget:
            return 0
        if not np.array_equal(self.ntok - self.comp, np.ones(len(self.running), np.int64)):
            return 0
        if not bool((self.ntok > self.plen).all()):
            return 0  # someone's last prompt token is due: its first token is not a decode
        if self.head_admissible() and len(self.running) < self.budget:
            return 0
        k = int((self.lim - self.ntok).min()) - 1
        if k < 2:
            return 0
        free = self.pool.num_free()
        if self._blocks_needed(k) <= free:
            return k
        lo, hi = 0, k  # largest k with need <= free
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if self._blocks_needed(mid) <= free:
                lo = mid
            else:
                hi = mid - 1
        return lo

    def _blocks_needed(self, k: int) -> int:
        return int(np.maximum((self.comp + k + (self.bs - 1)) // self.bs - self.held, 0).sum())

    def commit_decode_stretch(self, ends: FloatArray) -> FloatArray:
        """Apply len(ends) pure-decode steps; returns the first step's ITL gaps."""
        k = int(ends.size)
        s0 = self.step_index
        self._record_times(s0, ends)
        self.step_index += k
        need = self._blocks_needed(k)
        self.pool.take(need)
        self.held = np.maximum((self.comp + k + (self.bs - 1)) // self.bs, self.held)
        gaps: FloatArray = ends[0] - self.last_t
        if self.record_itl:
            for j in np.flatnonzero(self.last_step != s0 - 1).tolist():
                seq = self.running[j]
                seq.runs.append(int(self.last_step[j]))
                seq.runs.append(s0)
        self.comp = self.comp + k
        self.ntok = self.ntok + k
        self.last_t[:] = ends[-1]
        self.last_step[:] = s0 + k - 1
        return gaps

    def abort(self, request_id: str) -> Seq | None:
        for j, seq in enumerate(self.running):
            if seq.rid == request_id:
                self._sync_out(j, seq)
                self._free_blocks(seq, keep_hashes=False)
                self._remove([j])
                return seq
        for seq in self.waiting:
            if seq.rid == request_id:
                self.waiting.remove(seq)
                return seq
        return None
