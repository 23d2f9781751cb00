"""vLLM V1's scheduler and paged KV cache, one engine step at a time (vLLM scheduler.py).

Most running requests are decoding: each step gives every one of them exactly one token. They are
held lazily (the "decode set"): a request's context is `a + G`, where G counts the decode steps
taken since it joined, so a step costs O(1) whatever the batch size: the KV tokens read are
`sum(a) + n G`, the blocks a step allocates are the decoders whose context is a multiple of the
block size (counted per residue), and finishes come off a heap keyed by the step at which each
request reaches its length limit. Requests still prefilling (a few at a time) are plain objects.
That covers every step in which the running requests get all the tokens they want (or only the
newest prefills are cut by the budget) and the KV cache has room. Any other step (the budget cuts
an older request, or KV allocation fails and preemption starts) runs the general path: the
running set is written out as numpy arrays in admission order, scheduled exactly as vLLM orders
it (preempting the most recently admitted request). Once there, the scheduler stays with the arrays
(where KV pressure makes such steps frequent, building and reading them back each time would cost
more than it saves) until a run of steps again needs nothing the lazy path lacks, then reads the
arrays back into the lazy form. Blocks are accounted by count;
only blocks that prefix caching can reuse carry a hash (shared-prefix blocks, and the full blocks
of a preempted request, which its recompute can hit).
"""

from __future__ import annotations

import heapq
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
    """One request inside the engine.

    While it is in the decode set (`dgen >= 0`) its comp, ntok, held and last_step are derived
    from `a` and the scheduler's counters (`Scheduler.sync`); otherwise they are authoritative.
    """

    __slots__ = (
        "a",
        "arrival",
        "cached_tokens",
        "comp",
        "dgen",
        "first_scheduled",
        "first_token_time",
        "held",
        "last_step",
        "lim",
        "max_tokens",
        "n_prefix_blocks",
        "ntok",
        "num_preemptions",
        "odd",
        "order",
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
        self.order = -1  # admission order while running (re-admission gets a new one)
        self.a = 0  # in the decode set: comp = a + G
        self.dgen = -1  # decode-set membership (its heap entry's id), -1 when not in it
        self.odd = False  # in the decode set, but its next token follows a gap (last_step)

    def block_hash(self, i: int) -> BlockHash:
        if i < self.n_prefix_blocks:
            assert self.pid is not None
            return ("p", self.pid, i)
        return ("r", self.rid, i)

    @property
    def output_len(self) -> int:
        return self.ntok - self.plen


@dataclass(slots=True)
class Batch:
    """What one step schedules (the inputs of the step-time model and of `commit`)."""

    n_tokens: int
    n_seqs: int
    ctx_tokens: int
    attn_pairs: float
    admitted: list[Seq]
    hits: list[int]  # prefix-cache hit tokens of each admitted request
    preempted: list[Seq]
    sched: IntArray = field(default_factory=_empty_i)  # general path: tokens per row
    fast: bool = False  # scheduled on the lazy path (see the module doc)
    n_dec: int = 0  # fast path: decode-set requests, one token each
    chunks: list[tuple[Seq, int]] = field(default_factory=list)  # fast path: the others
    # array path: > 0 when the first n_pure running rows all decode one token and every other
    # row was admitted in this step (lets `commit` skip the general bookkeeping)
    n_pure: int = 0
    lazy_ok: bool = False  # array path: the lazy path could have scheduled this step


@dataclass(slots=True)
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


# Rows of Scheduler.st (general path), one column per running request in admission order.
C, N, L, H, P, S = range(6)  # computed, tokens, limit, blocks held, prompt, step of last token
_ROWS = 6


_EMPTY = _empty_i()
_NO_SEQS: list[Seq] = []  # never appended to (see _commit_fast)
_NO_INTS: list[int] = []
# Steps in a row that the lazy path could have taken before the arrays are read back into it.
LAZY_AFTER_SIMPLE_STEPS = 16


def _by_order(seq: Seq) -> int:
    return seq.order


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
        self.waiting: deque[Seq] = deque()
        self.step_index = 0
        self._times = np.zeros(1024, dtype=np.float64)  # end time of every step, by index
        self.total_preemptions = 0
        # The lazy path of schedule/commit; off, every step takes the general path (for tests).
        self.pure_decode_path = True
        self._order = 0
        self._run: dict[int, Seq] = {}  # running requests by admission order
        self._by_rid: dict[str, Seq] = {}
        self._pre: list[Seq] = []  # running requests outside the decode set, admission order
        # The decode set (module doc).
        self.G = 0
        self._cnt = [0] * self.bs  # members by a % block size
        self._sum_a = 0
        self._n_dec = 0
        self._heap: list[tuple[int, int, Seq]] = []  # (G at which it finishes, dgen, seq)
        self._gen = 0
        self._d_last = -1  # the last step in which every member made a token
        self._d_max_order = -1  # at least the largest admission order in the set
        self._odd: list[Seq] = []
        # The general path's arrays, valid between its schedule and commit only.
        self._general = False
        self._simple_run = 0
        self._rows: list[Seq] = []
        self.st: IntArray = np.zeros((_ROWS, 0), dtype=np.int64)

    # ---- the running set -----------------------------------------------------------------

    @property
    def n_running(self) -> int:
        return len(self._rows) if self._general else len(self._run)

    @property
    def running(self) -> list[Seq]:
        """The running requests in admission order (a copy)."""
        return list(self._rows) if self._general else list(self._run.values())

    def has_work(self) -> bool:
        return bool(self._run or self._rows or self.waiting)

    def sync(self, seq: Seq) -> None:
        """Write a decode-set member's derived fields into it."""
        if seq.dgen >= 0:
            comp = seq.a + self.G
            seq.comp = comp
            seq.ntok = comp + 1
            seq.held = -(-comp // self.bs)
            if not seq.odd:
                seq.last_step = self._d_last

    def decode_ctx(self) -> int:
        """KV tokens read by the running requests' next decode step."""
        if self._general:
            return int(np.add.reduce(self.st[C]))
        return self._sum_a + self._n_dec * self.G

    def _d_add(self, seq: Seq, odd: bool) -> None:
        a = seq.comp - self.G
        seq.a = a
        self._gen += 1
        seq.dgen = gen = self._gen
        self._cnt[a % self.bs] += 1
        self._sum_a += a
        self._n_dec += 1
        heapq.heappush(self._heap, (seq.lim - a - 1, gen, seq))
        if seq.order > self._d_max_order:
            self._d_max_order = seq.order
        seq.odd = odd
        if odd:
            self._odd.append(seq)

    def _d_remove(self, seq: Seq) -> None:
        """Take a (synced) member out of the decode set; its heap entry goes stale."""
        a = seq.a
        self._cnt[a % self.bs] -= 1
        self._sum_a -= a
        self._n_dec -= 1
        seq.dgen = -1
        if seq.odd:
            seq.odd = False
            self._odd.remove(seq)

    def _place(self, seq: Seq, s: int) -> bool:
        """After step `s`: a running request that wants exactly one token, past its prompt,
        joins the decode set (odd if its last token was not made by step `s`)."""
        if seq.ntok - seq.comp == 1 and seq.ntok > seq.plen:
            self._d_add(seq, seq.last_step != s)
            return True
        return False

    def _enter(self, seq: Seq) -> None:
        self._order += 1
        seq.order = self._order
        self._run[seq.order] = seq
        self._by_rid[seq.rid] = seq

    def _leave(self, seq: Seq) -> None:
        del self._run[seq.order]
        del self._by_rid[seq.rid]

    # ---- bookkeeping helpers -------------------------------------------------------------

    def step_end_time(self, s: int) -> float:
        return float(self._times[s])

    def _grow_times(self, upto: int) -> None:
        while upto > self._times.size:
            self._times = np.concatenate([self._times, np.zeros(self._times.size)])

    def private_blocks_running(self) -> int:
        """Blocks held by running requests and not shared through the cache (for invariants)."""
        if self._general:
            return int(self.st[H].sum()) - sum(len(q.shared) for q in self._rows)
        total = 0
        for seq in self.running:
            self.sync(seq)
            total += seq.held - len(seq.shared)
        return total

    def token_times(self, seq: Seq) -> FloatArray:
        """Times of a request's tokens, rebuilt from its runs of consecutive steps."""
        runs = [*seq.runs, seq.last_step] if len(seq.runs) % 2 else seq.runs
        if not runs:
            return np.zeros(0)
        if len(runs) == 2:  # one run (never preempted): a copy of a slice
            out1: FloatArray = self._times[runs[0] : runs[1] + 1].copy()
            return out1
        idx = np.concatenate([np.arange(runs[i], runs[i + 1] + 1) for i in range(0, len(runs), 2)])
        out: FloatArray = self._times[idx]
        return out

    # ---- admission -----------------------------------------------------------------------

    def _lookup_hits(self, seq: Seq) -> tuple[list[BlockHash], int]:
        """Longest run of cached full blocks (at least the last token is recomputed)."""
        if not self.caching:
            return [], 0
        # Only shared-prefix blocks and the parked blocks of a preempted request carry hashes.
        n = (seq.ntok - 1) // self.bs
        if not seq.num_preemptions:
            n = min(n, seq.n_prefix_blocks)
            if not n:
                return [], 0
        hits: list[BlockHash] = []
        evictable = 0
        pool = self.pool
        for i in range(n):
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
        if not self.waiting or self.n_running >= self.mns:
            return False
        seq = self.waiting[0]
        hits, evictable = self._lookup_hits(seq)
        need = -(-seq.ntok // self.bs) - len(hits)
        return need <= self.pool.num_free() - evictable

    def _admit(
        self, budget_left: int, n_running: int, now: float
    ) -> tuple[list[Seq], list[int], list[int]]:
        """Take waiting requests FCFS while budget, seats and KV blocks allow."""
        admitted: list[Seq] = []
        hits_tokens: list[int] = []
        chunks: list[int] = []
        pool = self.pool
        bs = self.bs
        waiting = self.waiting
        thr = self.thr if (self.thr > 0 and n_running + len(waiting) > 1) else 0
        seats = self.mns - n_running
        caching = self.caching
        while budget_left > 0 and waiting and len(admitted) < seats:
            seq = waiting[0]
            if caching and (seq.n_prefix_blocks or seq.num_preemptions):
                hits, evictable = self._lookup_hits(seq)
                nhit = len(hits)
            else:
                hits, evictable, nhit = [], 0, 0
            ntok = seq.ntok
            free = pool.free_uncached + len(pool.evictable)
            # scheduler_reserve_full_isl: the whole sequence must fit, not just the chunk.
            if -(-ntok // bs) - nhit > free - evictable:
                break
            comp0 = nhit * bs
            num_new = ntok - comp0
            if thr and num_new > thr:
                num_new = thr
            if num_new > budget_left:
                if not self.chunked:
                    break
                num_new = budget_left
            for h in hits:
                pool.acquire(h)
            new_blocks = -(-(comp0 + num_new) // bs) - nhit
            if new_blocks <= pool.free_uncached:
                pool.free_uncached -= new_blocks
            else:
                pool.take(new_blocks)
            waiting.popleft()
            seq.shared = hits
            seq.comp = comp0
            seq.held = nhit + new_blocks
            if seq.first_scheduled is None:
                seq.first_scheduled = now
            admitted.append(seq)
            hits_tokens.append(comp0)
            chunks.append(num_new)
            budget_left -= num_new
        return admitted, hits_tokens, chunks

    # ---- one step ------------------------------------------------------------------------

    def schedule(self, now: float) -> Batch:
        if self.pure_decode_path and not self._general:
            batch = self._schedule_fast(now)
            if batch is not None:
                return batch
        if not self._general:
            self._materialize()
        return self._schedule_arrays(now)

    def _schedule_fast(self, now: float) -> Batch | None:
        """The lazy step, or None when it does not apply (then nothing was changed)."""
        bs = self.bs
        n_run = len(self._run)
        thr = self.thr if (self.thr > 0 and n_run + len(self.waiting) > 1) else 0
        n_dec = self._n_dec
        left = self.budget - n_dec
        need = self._cnt[-self.G % bs] if n_dec else 0
        chunks: list[tuple[Seq, int]] = []
        all_one = True  # every running request wants exactly one token
        cut = False
        pre = self._pre
        for seq in pre:
            w = seq.ntok - seq.comp
            if thr and w > thr:
                w = thr
            if w != 1:
                all_one = False
            if w > left:
                cut = True
                w = left
            if w > 0:
                chunks.append((seq, w))
                need += -(-(seq.comp + w) // bs) - seq.held
                left -= w
        if cut and pre[0].order < self._d_max_order:
            return None  # the budget would stop at an older request: general path
        if need > self.pool.num_free():
            return None  # preemption: general path
        self.pool.take(need)
        for seq, w in chunks:
            seq.held = -(-(seq.comp + w) // bs)
        n_run_tokens = self.budget - left
        if self.waiting:
            admitted, hits, new = self._admit(left, n_run, now)
        else:
            admitted, hits, new = [], [], []
        ctx = self._sum_a + n_dec * self.G
        if all_one:
            # The formula of a step of single tokens (kept for identical floating point).
            for seq, _ in chunks:
                ctx += seq.comp
            pairs = float(ctx + n_run)
            n_tokens = n_run_tokens
            for c0, ch in zip(hits, new, strict=True):
                ctx += c0
                pairs += ch * (c0 + (ch + 1) / 2.0)
                n_tokens += ch
            n_seqs = n_run + len(admitted)
        else:
            s1 = ctx
            s2 = n_dec
            n_tokens = n_run_tokens
            n_seqs = n_dec + len(chunks) + len(admitted)
            for seq, w in chunks:
                ctx += seq.comp
                s1 += w * seq.comp
                s2 += w * w
            for c0, ch in zip(hits, new, strict=True):
                ctx += c0
                s1 += ch * c0
                s2 += ch * ch
                n_tokens += ch
            pairs = float(s1) + (float(s2) + n_tokens) / 2.0
        if admitted:
            run = self._run
            by_rid = self._by_rid
            order = self._order
            for seq, ch in zip(admitted, new, strict=True):
                order += 1
                seq.order = order
                run[order] = seq
                by_rid[seq.rid] = seq
                pre.append(seq)
                chunks.append((seq, ch))
            self._order = order
        return Batch(n_tokens, n_seqs, ctx, pairs, admitted, hits, [], _EMPTY, True, n_dec, chunks)

    def commit(self, batch: Batch, t_end: float, want_tokens: bool = False) -> StepOutcome:
        """Apply a scheduled step that ends at `t_end`: tokens, prefix blocks, finishes."""
        s = self.step_index
        self.step_index += 1
        if s >= self._times.size:
            self._grow_times(s + 1)
        self._times[s] = t_end
        if batch.fast:
            return self._commit_fast(batch, s, t_end, want_tokens)
        return self._commit_general(batch, s, t_end, want_tokens)

    def _commit_fast(self, b: Batch, s: int, t_end: float, want_tokens: bool) -> StepOutcome:
        times = self._times
        gap = t_end - float(times[s - 1]) if s > 0 else 0.0
        odd: list[tuple[int, float]] = []
        first_tokens: list[Seq] = []
        finished: list[Seq] = []
        # Only filled when asked for; shared empty lists otherwise (fewer allocations per step).
        token_seqs: list[Seq] = [] if want_tokens else _NO_SEQS
        token_index: list[int] = [] if want_tokens else _NO_INTS
        n_dec = b.n_dec
        produced = n_regular = n_dec
        self._d_last = s  # every member makes a token in this step
        bs = self.bs
        g = self.G
        if n_dec:
            if self._odd:
                odd = self._take_odd(t_end, s)
                n_regular -= len(odd)
            if want_tokens:
                for seq in self._run.values():
                    if seq.dgen >= 0:
                        token_seqs.append(seq)
                        token_index.append(seq.a + g + 1 - seq.plen)
            self.G = g = g + 1
            heap = self._heap
            if heap[0][0] <= g:
                cnt = self._cnt
                while heap and heap[0][0] <= g:
                    _, gen, seq = heapq.heappop(heap)
                    if seq.dgen == gen:  # finished: leaves the decode set (derived fields first)
                        a = seq.a
                        seq.comp = comp = a + g
                        seq.ntok = comp + 1
                        seq.held = -(-comp // bs)
                        seq.last_step = s
                        cnt[a % bs] -= 1
                        self._sum_a -= a
                        self._n_dec -= 1
                        seq.dgen = -2
                        finished.append(seq)
        chunks = b.chunks
        if chunks:
            for seq, w in chunks:
                seq.comp += w
                if w > 1 and seq.n_prefix_blocks > len(seq.shared) and self.caching:
                    self._register_prefix_blocks(seq)
            moved = False
            for seq, _ in chunks:
                ntok = seq.ntok
                if seq.comp == ntok:
                    produced += 1
                    if want_tokens:
                        token_seqs.append(seq)
                        token_index.append(ntok - seq.plen)
                    if ntok == seq.plen:  # the prompt just completed for the first time
                        seq.first_token_time = t_end
                        seq.runs = [s]
                        first_tokens.append(seq)
                    else:  # a recompute that caught up
                        ls = seq.last_step
                        odd.append((seq.order, t_end - float(times[ls])))
                        if self.record_itl:
                            seq.runs.append(ls)
                            seq.runs.append(s)
                    seq.ntok = ntok = ntok + 1
                    seq.last_step = s
                    moved = True
                    if ntok >= seq.lim:
                        seq.dgen = -2  # finished
                        finished.append(seq)
                        continue
                    # _d_add(seq, False), inlined: every request passes here once
                    a = seq.comp - g
                    seq.a = a
                    self._gen = gen = self._gen + 1
                    seq.dgen = gen
                    self._cnt[a % bs] += 1
                    self._sum_a += a
                    self._n_dec += 1
                    heapq.heappush(self._heap, (seq.lim - a - 1, gen, seq))
                    if seq.order > self._d_max_order:
                        self._d_max_order = seq.order
                elif ntok - seq.comp == 1 and ntok > seq.plen:  # a recompute's last token is due
                    moved = True
                    self._d_add(seq, True)
            if moved:
                self._pre = [seq for seq in self._pre if seq.dgen == -1]
        if finished:
            if len(finished) > 1:
                finished.sort(key=_by_order)
            pool = self.pool
            run = self._run
            by_rid = self._by_rid
            for seq in finished:
                seq.dgen = -1
                if seq.shared:
                    self._free_blocks(seq, keep_hashes=False)
                else:
                    pool.free_uncached += seq.held
                    seq.held = 0
                del run[seq.order]
                del by_rid[seq.rid]
        if len(odd) > 1:
            odd.sort()
        gaps = [x for _, x in odd] if odd else []
        return StepOutcome(produced, gap, n_regular, gaps, first_tokens, finished, token_seqs,
                           token_index)  # fmt: skip

    # ---- the general path -----------------------------------------------------------------

    def _materialize(self) -> None:
        """Write the running set out as arrays in admission order and empty the lazy state."""
        rows = list(self._run.values())
        for seq in rows:
            self.sync(seq)
            seq.dgen = -1
            seq.odd = False
        cols = [(q.comp, q.ntok, q.lim, q.held, q.plen, q.last_step) for q in rows]
        self.st = np.array(cols, dtype=np.int64).T if cols else np.zeros((_ROWS, 0), dtype=np.int64)
        self._rows = rows
        self._general = True
        self._simple_run = 0
        self._run = {}
        self._by_rid = {}
        self._pre = []
        self._cnt = [0] * self.bs
        self._sum_a = 0
        self._n_dec = 0
        self._heap = []
        self._odd = []
        self._d_max_order = -1

    def _read_back(self, s: int) -> None:
        """After a general step `s`: rebuild the lazy state from the arrays."""
        st = self.st
        cols = zip(st[C].tolist(), st[N].tolist(), st[H].tolist(), st[S].tolist(), strict=True)
        self._general = False
        self._d_last = s
        pre = self._pre
        for seq, (comp, ntok, held, last) in zip(self._rows, cols, strict=True):
            seq.comp = comp
            seq.ntok = ntok
            seq.held = held
            seq.last_step = last
            self._run[seq.order] = seq
            self._by_rid[seq.rid] = seq
            if not self._place(seq, s):
                pre.append(seq)
        self._rows = []
        self.st = np.zeros((_ROWS, 0), dtype=np.int64)

    def _schedule_arrays(self, now: float) -> Batch:
        """One step over the arrays, in vLLM's order (decodes and running prefills first, cut by
        the budget in admission order, preempting from the tail when blocks run out)."""
        bs = self.bs
        budget = self.budget
        thr = self.thr if (self.thr > 0 and len(self._rows) + len(self.waiting) > 1) else 0
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
        lazy_ok = all_active and not preempted
        admitted: list[Seq] = []
        hits_tokens: list[int] = []
        chunks: list[int] = []
        if not preempted:
            admitted, hits_tokens, chunks = self._admit(budget_left, len(self._rows), now)
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
                         n_pure=n_pure, lazy_ok=lazy_ok)  # fmt: skip
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
        return Batch(n_tokens, n_seqs, ctx, pairs, admitted, hits_tokens, preempted, sched,
                     lazy_ok=lazy_ok)  # fmt: skip

    def _append_running(self, seqs: list[Seq]) -> None:
        for seq in seqs:
            self._order += 1
            seq.order = self._order
        self._rows.extend(seqs)
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
        for j in sorted(idx, reverse=True):
            del self._rows[j]
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
        j = len(self._rows) - 1
        seq = self._rows[j]
        self._sync_out(j, seq)
        self._free_blocks(seq, keep_hashes=True)
        seq.comp = 0
        seq.num_preemptions += 1
        self.total_preemptions += 1
        self._rows.pop()
        self.st = self.st[:, :j]
        self.waiting.appendleft(seq)
        return seq

    def _schedule_running_sequential(self, want: IntArray, preempted: list[Seq]) -> IntArray:
        """Step 1 request by request, preempting from the tail when blocks run out."""
        bs = self.bs
        sched = np.zeros(len(self._rows), dtype=np.int64)
        budget_left = self.budget
        i = 0
        while i < len(self._rows) and budget_left > 0:
            n = min(int(want[i]), budget_left)
            need = -(-(int(self.st[C, i]) + n) // bs) - int(self.st[H, i])
            self_preempted = False
            while need > self.pool.num_free():
                victim = len(self._rows) - 1
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

    def _commit_general(self, batch: Batch, s: int, t_end: float, want_tokens: bool) -> StepOutcome:
        if batch.n_pure:
            out = self._commit_pure(batch, s, t_end, want_tokens)
        else:
            out = self._commit_arrays(batch, s, t_end, want_tokens)
        self._simple_run = self._simple_run + 1 if batch.lazy_ok else 0
        if self.pure_decode_path and self._simple_run >= LAZY_AFTER_SIMPLE_STEPS:
            self._read_back(s)
        return out

    def _commit_arrays(self, batch: Batch, s: int, t_end: float, want_tokens: bool) -> StepOutcome:
        sched = batch.sched
        if sched.size == 0:
            return StepOutcome(0, 0.0, 0, [], [], [], [], [])
        st = self.st
        rows = self._rows
        st[C] += sched
        if self.caching and batch.n_tokens > batch.n_seqs:
            for j in np.flatnonzero(sched > 1).tolist():
                rows[j].comp = int(st[C, j])
                self._register_prefix_blocks(rows[j])
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
                    seq = rows[j]
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
                    token_seqs.append(rows[j])
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
                    seq = rows[j]
                    self._sync_out(j, seq)
                    self._free_blocks(seq, keep_hashes=False)
                    finished.append(seq)
                self._remove(done)
        return StepOutcome(m, gap, n_regular, odd, first_tokens, finished, token_seqs, token_index)

    def _commit_pure(self, batch: Batch, s: int, t_end: float, want_tokens: bool) -> StepOutcome:
        """Array `commit` when the old rows all decoded one token and the rest were admitted."""
        st = self.st
        rows = self._rows
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
            token_seqs.extend(rows[:n])
            token_index.extend((old[N] - old[P]).tolist())
        first_tokens: list[Seq] = []
        if n_regular < n:  # a last prompt token, or after a starved step or a recompute
            for j in np.flatnonzero(last != s - 1).tolist():
                seq = rows[j]
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
            for j in range(n, total):
                if self.caching and sched[j] > 1:
                    rows[j].comp = int(st[C, j])
                    self._register_prefix_blocks(rows[j])
                if st[C, j] == st[N, j]:
                    seq = rows[j]
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
                seq = rows[j]
                self._sync_out(j, seq)
                self._free_blocks(seq, keep_hashes=False)
                finished.append(seq)
            self._remove(done)
        return StepOutcome(
            produced, gap, n_regular, odd, first_tokens, finished, token_seqs, token_index
        )

    def _register_prefix_blocks(self, seq: Seq) -> None:
        """Cache the shared-prefix blocks a prefill chunk just completed (seq.comp is current)."""
        if len(seq.shared) >= seq.n_prefix_blocks:
            return
        n_full = min(seq.comp // self.bs, seq.n_prefix_blocks)
        while len(seq.shared) < n_full:
            h = seq.block_hash(len(seq.shared))
            if not self.pool.register(h):
                seq.n_prefix_blocks = len(seq.shared)  # someone else cached it first
                break
            seq.shared.append(h)

    # ---- skip-ahead over pure-decode stretches -----------------------------------------------

    def _array_stretch_limit(self) -> int:
        """decode_stretch_limit over the arrays."""
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

        def needed(steps: int) -> int:
            return int(np.add.reduce((st[C] + steps + (self.bs - 1)) // self.bs)) - int(
                np.add.reduce(st[H])
            )

        if needed(k) <= free:
            return k
        lo, hi = 0, k
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if needed(mid) <= free:
                lo = mid
            else:
                hi = mid - 1
        return lo

    def _array_commit_stretch(self, ends: FloatArray) -> tuple[float, int, list[float]]:
        k = int(ends.size)
        s0 = self.step_index
        self._grow_times(s0 + k)
        self._times[s0 : s0 + k] = ends
        self.step_index += k
        st = self.st
        new_held = (st[C] + k + (self.bs - 1)) // self.bs
        self.pool.take(int(np.add.reduce(new_held)) - int(np.add.reduce(st[H])))
        st[H] = new_held
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
                    seq = self._rows[j]
                    seq.runs.append(ls)
                    seq.runs.append(s0)
        gap = float(ends[0]) - float(self._times[s0 - 1]) if s0 > 0 else 0.0
        st[C] += k
        st[N] += k
        st[S] = s0 + k - 1
        return gap, n_regular, odd

    def decode_stretch_limit(self) -> int:
        """How many pure-decode steps can run before anything but decoding happens.

        0 unless every running request is in the decode set and the waiting head cannot be
        admitted. The bound stops one step before the first finish, and where the blocks the
        stretch allocates would exceed the free ones (so no preemption can happen inside it).
        """
        if self._general:
            return self._array_stretch_limit()
        if self._pre:
            return 0
        n = len(self._run)
        if not n or n > self.budget:
            return 0
        heap = self._heap
        while heap[0][1] != heap[0][2].dgen:
            heapq.heappop(heap)
        k = heap[0][0] - self.G - 1
        if k < 2:
            return 0
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
        """Blocks the decode set allocates over the next k steps: one per member each time its
        context reaches a multiple of the block size."""
        bs = self.bs
        g = self.G
        total = 0
        for r, count in enumerate(self._cnt):
            if count:
                first = -(r + g) % bs  # steps until this residue's context is a multiple
                if first < k:
                    total += count * ((k - 1 - first) // bs + 1)
        return total

    def _take_odd(self, t: float, s: int) -> list[tuple[int, float]]:
        """(order, gap) of the decode-set members whose token of step `s` (ending at `t`)
        follows a gap; they are regular from then on."""
        out = []
        for seq in sorted(self._odd, key=_by_order):
            ls = seq.last_step
            out.append((seq.order, t - float(self._times[ls])))
            if self.record_itl:
                seq.runs.append(ls)
                seq.runs.append(s)
            seq.odd = False
        self._odd = []
        return out

    def commit_decode_stretch(self, ends: FloatArray) -> tuple[float, int, list[float]]:
        """Apply len(ends) pure-decode steps; returns the first step's gaps like StepOutcome."""
        if self._general:
            return self._array_commit_stretch(ends)
        k = int(ends.size)
        s0 = self.step_index
        self._grow_times(s0 + k)
        self._times[s0 : s0 + k] = ends
        self.step_index += k
        self.pool.take(self._blocks_needed(k))
        odd: list[float] = []
        n_regular = self._n_dec
        if self._odd:
            odd = [gap for _, gap in self._take_odd(float(ends[0]), s0)]
            n_regular -= len(odd)
        gap = float(ends[0]) - float(self._times[s0 - 1]) if s0 > 0 else 0.0
        self.G += k
        self._d_last = s0 + k - 1
        return gap, n_regular, odd

    def abort(self, request_id: str) -> Seq | None:
        if self._general:
            for j, row in enumerate(self._rows):
                if row.rid == request_id:
                    self._sync_out(j, row)
                    self._free_blocks(row, keep_hashes=False)
                    self._remove([j])
                    return row
            return self._abort_waiting(request_id)
        seq = self._by_rid.get(request_id)
        if seq is not None:
            if seq.dgen >= 0:
                self.sync(seq)
                self._d_remove(seq)
            else:
                self._pre.remove(seq)
            self._leave(seq)
            self._free_blocks(seq, keep_hashes=False)
            return seq
        return self._abort_waiting(request_id)

    def _abort_waiting(self, request_id: str) -> Seq | None:
        for seq in self.waiting:
            if seq.rid == request_id:
                self.waiting.remove(seq)
                return seq
        return None
