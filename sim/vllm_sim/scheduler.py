"""vLLM V1's scheduler and paged KV cache, one engine step at a time (vLLM scheduler.py).

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
        "lim",
        "max_tokens",
        "n_prefix_blocks",
        "ntok",
        "num_preemptions",
        "pid",
        "plen",
        "queried",
        "queued_at",
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
        self.queued_at = arrival  # when the engine core queued it (after the frontend)
        self.last_step = -2
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
    # > 0: the first n_pure running rows are all plain decodes (one token each) and every
    # other row was admitted in this step; lets `commit` skip the general bookkeeping.
    n_pure: int = 0


@dataclass
class StepOutcome:
    """What one step produced, for the engine's records and metrics.

    Inter-token gaps come in two parts: `n_regular` requests whose previous token came out of
    the previous step all share the gap `regular_gap`; the few others are listed in `odd_gaps`.
    """

    n_generated: int
    regular_gap: float
    n_regular: int
    odd_gaps: list[float]
    first_tokens: list[Seq]
    finished: list[Seq]
    token_seqs: list[Seq]  # only filled when asked for (streaming)
    token_index: list[int]


# Rows of Scheduler.st, one column per running request in admission order.
C, N, L, H, P, S = range(6)  # computed, tokens, limit, blocks held, prompt, step of last token
_ROWS = 6


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
        self.st: IntArray = np.zeros((_ROWS, 0), dtype=np.int64)
        self.step_index = 0
        self._times = np.zeros(1024, dtype=np.float64)  # end time of every step, by index
        self.total_preemptions = 0
        # The pure-decode shortcut of schedule/commit; off gives the general path (for tests).
        self.pure_decode_path = True

    # ---- bookkeeping helpers -------------------------------------------------------------

    @property
    def comp(self) -> IntArray:
        out: IntArray = self.st[C]
        return out

    @property
    def held(self) -> IntArray:
        out: IntArray = self.st[H]
        return out

    def step_end_time(self, s: int) -> float:
        return float(self._times[s])

    def _grow_times(self, upto: int) -> None:
        while upto > self._times.size:
            self._times = np.concatenate([self._times, np.zeros(self._times.size)])

    def private_blocks_running(self) -> int:
        """Blocks held by running requests and not shared through the cache (for invariants)."""
        return int(self.st[H].sum()) - sum(len(s.shared) for s in self.running)

    def token_times(self, seq: Seq) -> FloatArray:
        """Times of a request's tokens, rebuilt from its runs of consecutive steps."""
        runs = [*seq.runs, seq.last_step] if len(seq.runs) % 2 else seq.runs
        if not runs:
            return np.zeros(0)
        idx = np.concatenate([np.arange(runs[i], runs[i + 1] + 1) for i in range(0, len(runs), 2)])
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
        all_active = True
        st = self.st
        n_old = st.shape[1]
        n_pure = 0
        ctx = 0
        pairs = 0.0
        if n_old:
            comp = st[C]
            want = st[N] - comp
            if thr:
                np.minimum(want, thr, out=want)
            n_run_tokens = int(np.add.reduce(want))
            if n_run_tokens == n_old and n_old <= budget and self.pure_decode_path:
                # Every running request decodes one token: a block is due where comp % bs == 0.
                sched = want
                due = comp % bs == 0
                need = int(np.count_nonzero(due))
                if need <= self.pool.num_free():
                    self.pool.take(need)
                    st[H] += due
                    n_pure = n_old
                    ctx = int(np.add.reduce(comp))
                    pairs = float(ctx + n_old)
                else:
                    sched = self._schedule_running_sequential(want, preempted)
                    n_run_tokens = int(np.add.reduce(sched))
                    all_active = False
            else:
                if n_run_tokens <= budget:
                    sched = want
                else:
                    before = np.cumsum(want) - want
                    sched = np.minimum(want, np.maximum(budget - before, 0))
                    n_run_tokens = int(np.add.reduce(sched))
                    all_active = False
                new_held = (comp + sched + (bs - 1)) // bs
                need = int(np.add.reduce(new_held)) - int(np.add.reduce(st[H]))
                if need <= self.pool.num_free():
                    self.pool.take(need)
                    st[H] = new_held
                else:
                    sched = self._schedule_running_sequential(want, preempted)
                    n_run_tokens = int(np.add.reduce(sched))
                    all_active = False
            budget_left = budget - n_run_tokens
        else:
            sched = _empty_i()
            n_run_tokens = 0
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
        n_tokens = n_run_tokens
        if n_pure or not n_old:
            # Admitted chunks: context = their cache hits, pairs = chunk x (hits + (chunk+1)/2).
            n_seqs = n_old + len(admitted)
            for c0, ch in zip(hits_tokens, chunks, strict=True):
                ctx += c0
                pairs += ch * (c0 + (ch + 1) / 2.0)
                n_tokens += ch
            if admitted:
                self._append_running(admitted)
                sched = np.concatenate([sched, np.asarray(chunks, dtype=np.int64)])
            return Batch(n_tokens, n_seqs, ctx, pairs, admitted, hits_tokens, preempted, sched,
                         n_pure)  # fmt: skip
        if admitted:
            self._append_running(admitted)
            sched = np.concatenate([sched, np.asarray(chunks, dtype=np.int64)])
            n_tokens += sum(chunks)
        comp = self.st[C]
        if all_active:
            n_seqs = int(sched.size)
            ctx = int(np.add.reduce(comp))
        else:
            active = sched > 0
            n_seqs = int(np.count_nonzero(active))
            ctx = int(np.dot(comp, active))
        pairs = float(np.dot(sched, comp)) + (float(np.dot(sched, sched)) + n_tokens) / 2.0
        return Batch(n_tokens, n_seqs, ctx, pairs, admitted, hits_tokens, preempted, sched)

    def _append_running(self, seqs: list[Seq]) -> None:
        self.running.extend(seqs)
        cols = np.array(
            [(s.comp, s.ntok, s.lim, s.held, s.plen, s.last_step) for s in seqs], dtype=np.int64
        ).T
        self.st = np.concatenate([self.st, cols], axis=1)

    def _sync_out(self, j: int, seq: Seq) -> None:
        col = self.st[:, j].tolist()
        seq.comp = col[C]
        seq.ntok = col[N]
        seq.held = col[H]
        seq.last_step = col[S]

    def _remove(self, idx: list[int]) -> None:
        if len(idx) == 1:
            j = idx[0]
            del self.running[j]
            self.st = np.concatenate((self.st[:, :j], self.st[:, j + 1 :]), axis=1)
            return
        for j in sorted(idx, reverse=True):
            del self.running[j]
        keep = np.ones(self.st.shape[1], dtype=bool)
        keep[idx] = False
        self.st = self.st[:, keep]

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
        self.running.pop()
        self.st = self.st[:, :j]
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
            need = -(-(int(self.st[C, i]) + n) // bs) - int(self.st[H, i])
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
            self.st[H, i] += need
            sched[i] = n
            budget_left -= n
            i += 1
        return sched

    def commit(self, batch: Batch, t_end: float, want_tokens: bool = False) -> StepOutcome:
        """Apply a scheduled step that ends at `t_end`: tokens, prefix blocks, finishes."""
        s = self.step_index
        self.step_index += 1
        self._grow_times(s + 1)
        self._times[s] = t_end
        sched = batch.sched
        if sched.size == 0:
            return StepOutcome(0, 0.0, 0, [], [], [], [], [])
        st = self.st
        if batch.n_pure:
            return self._commit_pure(batch, s, t_end, want_tokens)
        st[C] += sched
        if self.caching and batch.n_tokens > batch.n_seqs:
            self._register_prefix_blocks(np.flatnonzero(sched > 1))
        idx = np.flatnonzero(st[C] == st[N])  # sched == 0 rows never reach their token count
        first_tokens: list[Seq] = []
        finished: list[Seq] = []
        token_seqs: list[Seq] = []
        token_index: list[int] = []
        odd: list[float] = []
        n_regular = 0
        gap = 0.0
        m = int(idx.size)
        if m:
            every = m == st.shape[1]  # the usual step: every running request made a token
            sub = st if every else st[:, idx]
            last = sub[S]
            regular = last == s - 1
            n_regular = int(np.count_nonzero(regular))
            if s > 0:
                gap = t_end - float(self._times[s - 1])
            if n_regular < m:
                for j, ls, nt, pl in zip(
                    idx[~regular].tolist(),
                    last[~regular].tolist(),
                    sub[N][~regular].tolist(),
                    sub[P][~regular].tolist(),
                    strict=True,
                ):
                    seq = self.running[j]
                    if nt == pl:  # the prompt just completed for the first time
                        seq.first_token_time = t_end
                        seq.runs = [s]
                        first_tokens.append(seq)
                    else:  # after a starved step or a recompute
                        odd.append(t_end - float(self._times[ls]))
                        if self.record_itl:
                            seq.runs.append(ls)
                            seq.runs.append(s)
            if want_tokens:
                for j, o in zip(idx.tolist(), (sub[N] - sub[P]).tolist(), strict=True):
                    token_seqs.append(self.running[j])
                    token_index.append(o)
            if every:
                st[N] += 1
                st[S] = s
                done = np.flatnonzero(st[N] >= st[L]).tolist()
            else:
                done = idx[sub[N] + 1 >= sub[L]].tolist()
                st[N, idx] += 1
                st[S, idx] = s
            if done:
                for j in done:
                    seq = self.running[j]
                    self._sync_out(j, seq)
                    self._free_blocks(seq, keep_hashes=False)
                    finished.append(seq)
                self._remove(done)
        return StepOutcome(m, gap, n_regular, odd, first_tokens, finished, token_seqs, token_index)

    def _commit_pure(self, batch: Batch, s: int, t_end: float, want_tokens: bool) -> StepOutcome:
        """`commit` when the old rows all decoded one token and the rest were just admitted."""
        st = self.st
        n = batch.n_pure
        old = st[:, :n]
        old[C] += 1
        last = old[S]
        n_regular = int(np.count_nonzero(last == s - 1))
        gap = t_end - float(self._times[s - 1]) if s > 0 else 0.0
        odd: list[float] = []
        token_seqs: list[Seq] = []
        token_index: list[int] = []
        if want_tokens:
            token_seqs.extend(self.running[:n])
            token_index.extend((old[N] - old[P]).tolist())
        first_tokens: list[Seq] = []
        if n_regular < n:  # a last prompt token, or after a starved step or a recompute
            for j in np.flatnonzero(last != s - 1).tolist():
                seq = self.running[j]
                if old[N, j] == old[P, j]:
                    seq.first_token_time = t_end
                    seq.runs = [s]
                    first_tokens.append(seq)
                    continue
                ls = int(last[j])
                odd.append(t_end - float(self._times[ls]))
                if self.record_itl:
                    seq.runs.append(ls)
                    seq.runs.append(s)
        old[N] += 1
        old[S] = s
        produced = n
        total = st.shape[1]
        if total > n:  # admitted this step: prefill chunks
            sched = batch.sched
            st[C, n:] += sched[n:]
            if self.caching:
                self._register_prefix_blocks(np.arange(n, total)[sched[n:] > 1])
            for j in range(n, total):
                if st[C, j] == st[N, j]:
                    seq = self.running[j]
                    produced += 1
                    if want_tokens:
                        token_seqs.append(seq)
                        token_index.append(int(st[N, j] - st[P, j]))
                    if st[N, j] == st[P, j]:  # first token
                        seq.first_token_time = t_end
                        seq.runs = [s]
                        first_tokens.append(seq)
                    else:  # a recompute that caught up
                        ls = int(st[S, j])
                        odd.append(t_end - float(self._times[ls]))
                        if self.record_itl:
                            seq.runs.append(ls)
                            seq.runs.append(s)
                    st[N, j] += 1
                    st[S, j] = s
        finished: list[Seq] = []
        done = np.flatnonzero(st[N] >= st[L]).tolist()
        if done:
            for j in done:
                seq = self.running[j]
                self._sync_out(j, seq)
                self._free_blocks(seq, keep_hashes=False)
                finished.append(seq)
            self._remove(done)
        return StepOutcome(
            produced, gap, n_regular, odd, first_tokens, finished, token_seqs, token_index
        )

    def _register_prefix_blocks(self, idx: IntArray) -> None:
        for j in idx.tolist():
            seq = self.running[j]
            if len(seq.shared) >= seq.n_prefix_blocks:
                continue
            n_full = min(int(self.st[C, j]) // self.bs, seq.n_prefix_blocks)
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
        st = self.st
        n = st.shape[1]
        if not n or n > self.budget:
            return 0
        k = int((st[L] - st[N]).min()) - 1
        if k < 2:
            return 0
        if int(np.add.reduce(st[N] - st[C])) != n:  # every row wants >= 1: all exactly 1
            return 0
        if int((st[N] - st[P]).min()) < 1:
            return 0  # someone's last prompt token is due: its first token is not a decode
        if n < self.budget and self.head_admissible():
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
        st = self.st
        return int(np.add.reduce((st[C] + k + (self.bs - 1)) // self.bs)) - int(
            np.add.reduce(st[H])
        )

    def commit_decode_stretch(self, ends: FloatArray) -> tuple[float, int, list[float]]:
        """Apply len(ends) pure-decode steps; returns the first step's gaps like StepOutcome."""
        k = int(ends.size)
        s0 = self.step_index
        self._grow_times(s0 + k)
        self._times[s0 : s0 + k] = ends
        self.step_index += k
        self.pool.take(self._blocks_needed(k))
        st = self.st
        st[H] = (st[C] + k + (self.bs - 1)) // self.bs
        last = st[S]
        regular = last == s0 - 1
        n_regular = int(np.count_nonzero(regular))
        odd: list[float] = []
        if n_regular < last.size:
            for j, ls in zip(
                np.flatnonzero(~regular).tolist(), last[~regular].tolist(), strict=True
            ):
                odd.append(float(ends[0]) - float(self._times[ls]))
                if self.record_itl:
                    seq = self.running[j]
                    seq.runs.append(ls)
                    seq.runs.append(s0)
        gap = float(ends[0]) - float(self._times[s0 - 1]) if s0 > 0 else 0.0
        st[C] += k
        st[N] += k
        st[S] = s0 + k - 1
        return gap, n_regular, odd

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
