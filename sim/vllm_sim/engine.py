"""The simulated vLLM engine: virtual time, steps, records and live metrics.

The engine owns the clock. Each step starts when the previous one ends (or when work arrives at
an idle engine), is scheduled by `Scheduler`, lasts what `StepTimeModel` says, and produces its
tokens at its end. Long runs of pure decoding, where nothing but the step count changes, are
computed in one vectorised jump; `fast=False` turns that off to check it against step-by-step.
"""

from __future__ import annotations

import heapq
import math
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass

import numpy as np

from vllm_sim.catalog import GpuSpec, ModelSpec, load_gpu
from vllm_sim.kv import KVCacheInfo, engine_model, kv_cache_info, resolve_config
from vllm_sim.metrics import VllmMetrics, cache_config_labels
from vllm_sim.scheduler import Batch, Scheduler, Seq
from vllm_sim.steptime import CALIBRATION, Calibration, FloatArray, StepTimeModel
from vllm_sim.types import (
    EngineConfig,
    EngineCrashed,
    Reality,
    Request,
    RequestRecord,
    StartupError,
    TokenEvent,
)

_JITTER_BLOCK = 4096


@dataclass(frozen=True)
class StepStats:
    """One engine step as a test or tool sees it (only built when someone listens)."""

    index: int
    start: float
    end: float
    scheduled_tokens: int
    num_scheduled_seqs: int
    num_running: int
    num_waiting: int
    num_preempted: int
    num_admitted: int
    blocks_free_uncached: int
    blocks_cached_evictable: int
    blocks_used: int
    blocks_total: int
    skipped_ahead: bool = False


class _Arrivals:
    """Requests not yet visible to the scheduler, by (visible at, order): a deque for the usual
    in-order arrivals (O(1) at both ends) and a heap for the few that come out of order (a
    request added during a long step becomes visible at `now`). Indexing [0] is the earliest."""

    __slots__ = ("h", "q")

    def __init__(self) -> None:
        self.q: deque[tuple[float, int, Seq]] = deque()
        self.h: list[tuple[float, int, Seq]] = []

    def __bool__(self) -> bool:
        return bool(self.q) or bool(self.h)

    def __len__(self) -> int:
        return len(self.q) + len(self.h)

    def __iter__(self) -> Iterator[tuple[float, int, Seq]]:
        yield from self.q
        yield from self.h

    def __getitem__(self, i: int) -> tuple[float, int, Seq]:
        assert i == 0
        q, h = self.q, self.h
        if h and (not q or h[0] < q[0]):
            return h[0]
        return q[0]

    def push(self, item: tuple[float, int, Seq]) -> None:
        q = self.q
        if not q or item >= q[-1]:
            q.append(item)
        else:
            heapq.heappush(self.h, item)

    def pop(self) -> tuple[float, int, Seq]:
        q, h = self.q, self.h
        if h and (not q or h[0] < q[0]):
            return heapq.heappop(h)
        return q.popleft()

    def remove(self, rid: str) -> Seq | None:
        for i, (_, _, p) in enumerate(self.q):
            if p.rid == rid:
                del self.q[i]
                return p
        for i, (_, _, p) in enumerate(self.h):
            if p.rid == rid:
                self.h.pop(i)
                heapq.heapify(self.h)
                return p
        return None


class Engine:
    """A vLLM V1 engine in virtual time (API in the task brief; see module doc)."""

    def __init__(
        self,
        config: EngineConfig,
        reality: Reality | None = None,
        seed: int = 0,
        record_itl: bool = True,
        fast: bool = True,
        calibration: Calibration | None = None,
    ) -> None:
        self.config = config
        self.reality = reality or Reality()
        self.model: ModelSpec = engine_model(config)
        self.gpu: GpuSpec = load_gpu(config.gpu)
        self.resolved: EngineConfig = resolve_config(config, self.model, self.gpu)
        self.kv: KVCacheInfo = kv_cache_info(self.resolved, self.model, self.gpu)
        self.steptime = StepTimeModel(
            self.model,
            self.gpu,
            config.tensor_parallel_size,
            self.kv.kv_bytes_per_token,
            calibration=calibration or CALIBRATION,
            bandwidth_efficiency=self.reality.bandwidth_efficiency,
            compute_efficiency=self.reality.compute_efficiency,
        )
        self.sched = Scheduler(self.resolved, self.kv.num_gpu_blocks, record_itl)
        self.sched.pure_decode_path = fast
        assert self.resolved.max_model_len is not None
        self.max_model_len: int = self.resolved.max_model_len
        self.metrics = VllmMetrics(
            config.served_model_name or config.model,
            self.max_model_len,
            cache_config_labels(self._cache_config_fields()),
            config.show_hidden_metrics_for_version,
        )
        self.metrics.gauge_provider = self._gauges
        self.fast = fast
        self._caching = self.resolved.enable_prefix_caching
        self._async = config.async_scheduling
        # Seconds from arrival until the scheduler can see a request (Calibration.c_frontend_s).
        self.frontend_delay = (calibration or CALIBRATION).c_frontend_s
        self.record_itl = record_itl
        self.on_step: Callable[[StepStats], None] | None = None
        self.now = 0.0
        self._pending = _Arrivals()  # (visible at, order, seq)
        self._order = 0
        self._ids: set[str] = set()
        self._finished: list[RequestRecord] = []
        self._inflight: tuple[Batch, float, float] | None = None
        self._deferred_aborts: list[str] = []
        self._prev_start = -math.inf  # the last step's start and end (async scheduling)
        self._prev_end = -math.inf
        rng = np.random.default_rng(seed)
        self._jitter_rng = np.random.default_rng(rng.integers(2**63))
        self._jitter_buf: FloatArray = np.zeros(0)
        self._jitter_start = 0
        self._sigma = math.sqrt(math.log1p(self.reality.step_jitter**2))
        self._crash_at: float | None = None
        self._crashed = False
        # vLLM's shutdown (--shutdown-timeout): see begin_drain.
        self._drain_start: float | None = None
        self._drain_deadline: float | None = None
        r = self.reality
        if (
            r.oom_above_utilization is not None
            and self.resolved.gpu_memory_utilization > r.oom_above_utilization
            and (self.resolved.max_num_batched_tokens or 0) >= r.oom_min_batched_tokens
        ):
            self._crash_at = float(rng.exponential(r.oom_mean_time_s))

    # ---- public API -------------------------------------------------------------------------

    def add_request(self, req: Request) -> None:
        """Queue a request. One that arrived before `now` (e.g. during the step that just ran)
        is seen by the next step but keeps its arrival time for latency metrics."""
        if req.request_id in self._ids:
            raise ValueError(f"duplicate request id {req.request_id!r} (still in flight)")
        if req.prompt_len < 1 or req.max_tokens < 1:
            raise ValueError("prompt_len and max_tokens must be >= 1")
        if req.prompt_len + 1 > self.max_model_len:
            raise ValueError(
                f"This model's maximum context length is {self.max_model_len} tokens. However, "
                f"your request has {req.prompt_len} input tokens. Please reduce the length of "
                "the input messages."
            )
        if not math.isfinite(req.arrival_time):
            raise ValueError("arrival_time must be finite")
        seq = Seq(req, self.max_model_len, self.resolved.block_size, req.arrival_time)
        if self._drain_start is not None and req.arrival_time >= self._drain_start:
            # vLLM's EngineCore._reject_add_in_shutdown: finished at once as aborted.
            self._finish(seq, "abort", max(self.now, req.arrival_time))
            return
        self._ids.add(req.request_id)
        visible = max(req.arrival_time + self.frontend_delay, self.now)
        seq.queued_at = visible
        self._pending.push((visible, self._order, seq))
        self._order += 1

    def abort_request(self, request_id: str) -> None:
        """Abort a request; one inside the step already scheduled leaves when that step ends
        (as in vLLM, where an abort takes effect at the next schedule)."""
        if self._inflight is not None:
            self._deferred_aborts.append(request_id)
            return
        seq = self.sched.abort(request_id)
        if seq is None:
            seq = self._pending.remove(request_id)
        if seq is not None:
            self._finish(seq, "abort", max(self.now, seq.arrival))

    def has_unfinished(self) -> bool:
        return bool(self._pending or self.sched.has_work())

    def begin_drain(self, timeout_s: float, at: float | None = None) -> None:
        """Shut down as vLLM does on SIGTERM with `--shutdown-timeout timeout_s`.

        From virtual time `at` (default: now) the engine admits nothing new: a request arriving
        at or after it is finished at once with finish reason "abort", as vLLM's EngineCore
        rejects adds during shutdown (`vllm/v1/engine/core.py`, `_reject_add_in_shutdown`).
        Requests that arrived before it keep being served. With `timeout_s` 0 they are all
        aborted at once (vLLM's default); otherwise they run until `at + timeout_s`, and
        whatever is unfinished then is aborted at the first step boundary at or after that
        deadline (vLLM kills the engine process at the deadline; the difference is at most the
        step in progress). `drained` tells when nothing is left; calling it again only ever
        brings the deadline forward.
        """
        if timeout_s < 0 or not math.isfinite(timeout_s):
            raise ValueError(f"shutdown timeout must be a finite number >= 0, got {timeout_s}")
        start = self.now if at is None else at
        deadline = start + timeout_s
        if self._drain_start is None or start < self._drain_start:
            self._drain_start = start
        if self._drain_deadline is None or deadline < self._drain_deadline:
            self._drain_deadline = deadline
        self._drain_check()

    @property
    def draining(self) -> bool:
        """True once begin_drain was called (the engine then refuses new requests)."""
        return self._drain_start is not None

    @property
    def drained(self) -> bool:
        """True once draining and every request that was in flight has finished or aborted."""
        return self._drain_start is not None and not self.has_unfinished()

    @property
    def drain_deadline(self) -> float | None:
        """Virtual time at which a drain aborts what is still unfinished (None: no drain)."""
        return self._drain_deadline

    def pop_finished(self) -> list[RequestRecord]:
        out, self._finished = self._finished, []
        return out

    def next_event_time(self) -> float | None:
        """End of the next step (scheduling it now if work is ready), else the next arrival.

        With a run-time OOM pending it is never later than the crash, so that a caller that
        sleeps until then calls run_until and sees EngineCrashed; it never raises itself.
        """
        crash = self._crash_at
        if self._crashed or (crash is not None and self.now >= crash):
            return self.now
        nxt: float | None = None
        if self._inflight is not None:
            nxt = self._inflight[2]
        else:
            self._drain_check()
            self._release_arrivals()
            if self.sched.has_work():
                self._begin_step()
                assert self._inflight is not None
                nxt = self._inflight[2]
            elif self._pending:
                nxt = max(self.now, self._pending[0][0])
                deadline = self._drain_deadline
                if deadline is not None and nxt > deadline:
                    nxt = max(self.now, deadline)  # the drain aborts them before they are seen
        if crash is not None:
            return crash if nxt is None else min(nxt, crash)
        return nxt

    def run_until(
        self, t: float, on_tokens: Callable[[list[TokenEvent]], None] | None = None
    ) -> None:
        """Run every step that starts before `t`; afterwards now == max(t, end of last step)."""
        self._check_crash(self.now)
        while True:
            if self._inflight is not None:
                if self._inflight[1] >= t:
                    break
                self._end_step(on_tokens)
                continue
            if self._drain_deadline is not None:
                self._drain_check()
            self._release_arrivals()
            if not self.sched.has_work():
                if not self._pending:
                    break
                nxt = self._pending[0][0]
                if nxt >= t:
                    break
                self._check_crash(nxt)
                self.now = max(self.now, nxt)
                continue
            if self.now >= t:
                break
            if self._crash_at is not None:
                self._check_crash(self.now)
            if self.fast and on_tokens is None and not self.sched._pre and self._skip_ahead(t):
                continue
            self._begin_step()
            self._end_step(on_tokens)
        if self.now < t < math.inf:
            self._check_crash(t)
            self.now = t
        if self._drain_deadline is not None:
            self._drain_check()

    def run(self, requests: Iterable[Request]) -> list[RequestRecord]:
        for req in sorted(requests, key=lambda r: r.arrival_time):
            self.add_request(req)
        while self.has_unfinished():
            self.run_until(math.inf)
        return self.pop_finished()

    # ---- steps ------------------------------------------------------------------------------

    def _drain_check(self) -> None:
        """Between steps, once the drain deadline has come: abort everything unfinished."""
        deadline = self._drain_deadline
        if deadline is None or self.now < deadline or self._inflight is not None:
            return
        ids = [s.rid for s in self.sched.running] + [s.rid for s in self.sched.waiting]
        ids += [p[2].rid for p in sorted(self._pending)]
        for rid in ids:
            self.abort_request(rid)

    def _check_crash(self, t: float) -> None:
        if self._crashed or (self._crash_at is not None and t >= self._crash_at):
            if not self._crashed:
                self._crashed = True
                assert self._crash_at is not None
                self.now = max(self.now, self._crash_at)
            raise EngineCrashed(
                f"Tried to allocate 2.00 GiB at t={self._crash_at:.3f}s (virtual): the "
                "activation peak outgrew the memory gpu_memory_utilization left free."
            )

    def _arrival_cutoff(self) -> float:
        """Requests seen by the scheduler before this point join the step starting now.

        With async scheduling the step starting now was scheduled when the previous one
        started, if the engine was busy; an idle engine picks work up at once.
        """
        sched = self.sched
        if self.config.async_scheduling and sched.has_work() and self._prev_end >= self.now:
            return self._prev_start
        return self.now

    def _release_arrivals(self) -> None:
        pending = self._pending
        if not pending:
            return
        # _arrival_cutoff, inlined: this runs before every step.
        cutoff = self.now
        if self._async and self._prev_end >= cutoff and self.sched.has_work():
            cutoff = self._prev_start
        q = pending.q
        if pending.h:
            if pending[0][0] <= cutoff:
                waiting = self.sched.waiting
                while pending and pending[0][0] <= cutoff:
                    waiting.append(pending.pop()[2])
        elif q[0][0] <= cutoff:
            waiting = self.sched.waiting
            while q and q[0][0] <= cutoff:
                waiting.append(q.popleft()[2])

    def _jitter(self, first_step: int, n: int) -> FloatArray:
        """Multiplicative log-normal noise with mean 1, drawn per step index (in blocks, in
        order) so that a skip-ahead uses exactly the draws the same steps would one by one."""
        buf = self._jitter_buf
        while self._jitter_start + buf.size < first_step + n:
            buf = np.concatenate([buf, self._jitter_rng.standard_normal(_JITTER_BLOCK)])
        drop = (first_step - self._jitter_start) // _JITTER_BLOCK * _JITTER_BLOCK
        if drop > 0:
            buf = buf[drop:]
            self._jitter_start += drop
        self._jitter_buf = buf
        off = first_step - self._jitter_start
        z = buf[off : off + n]
        sig = self._sigma
        out: FloatArray = np.exp(sig * z - 0.5 * sig * sig)
        return out

    def _begin_step(self) -> None:
        t0 = self.now
        b = self.sched.schedule(t0)
        if b.n_tokens == 0:
            dt = self.steptime.idle_step_s
        else:
            dt = self.steptime.step_time(b.n_tokens, b.n_seqs, b.ctx_tokens, b.attn_pairs)
            if self.reality.step_jitter > 0:
                dt *= float(self._jitter(self.sched.step_index, 1)[0])
        dt += self.reality.per_request_overhead_s * len(b.admitted)
        self._inflight = (b, t0, t0 + dt)
        self._prev_start = t0
        self._prev_end = t0 + dt

    def _end_step(self, on_tokens: Callable[[list[TokenEvent]], None] | None) -> None:
        assert self._inflight is not None
        b, t0, t_end = self._inflight
        self._inflight = None
        m = self.metrics
        if b.admitted and self._caching:
            queries = m.prefix_rows  # observe_prefix_query, buffered
            for seq, hit in zip(b.admitted, b.hits, strict=True):
                if not seq.queried:
                    seq.queried = True
                    seq.cached_tokens = hit
                    queries.append((seq.ntok, hit))
        if b.preempted:
            m.num_preemptions.inc(len(b.preempted))
        want_tokens = on_tokens is not None
        out = self.sched.commit(b, t_end, want_tokens)
        self.now = t_end
        if b.n_tokens:
            m.iteration_tokens.observe(b.n_tokens)
        m.generation_tokens.values[""] += out.n_generated
        if out.n_regular:
            if m.tpot_hidden:
                m.observe_itl_repeated(out.regular_gap, out.n_regular)
            else:
                m.itl.observe_repeated(out.regular_gap, out.n_regular)
        if out.odd_gaps:
            m.observe_itl(np.asarray(out.odd_gaps))
        if out.first_tokens:
            firsts = m.first_rows  # observe_first_token, inlined
            for seq in out.first_tokens:
                firsts.append((t_end - seq.arrival, seq.plen, seq.cached_tokens))
            if len(firsts) >= 4096:
                m.flush()
        for seq in out.finished:
            self._finish(seq, "length", t_end)
        finished_ids: set[str] = set()
        if out.finished and (want_tokens or self._deferred_aborts):
            finished_ids = {seq.rid for seq in out.finished}
        if want_tokens and out.token_seqs:
            assert on_tokens is not None
            events = [
                TokenEvent(
                    s.rid,
                    i,
                    t_end,
                    s.rid in finished_ids,
                    "length" if s.rid in finished_ids else None,
                )
                for s, i in zip(out.token_seqs, out.token_index, strict=True)
            ]
            on_tokens(events)
        if self.on_step is not None:
            self.on_step(self._stats(self.sched.step_index - 1, t0, t_end, b, False))
        if self._deferred_aborts:
            aborts, self._deferred_aborts = self._deferred_aborts, []
            for rid in aborts:
                if rid not in finished_ids:
                    self.abort_request(rid)

    def _stats(self, index: int, t0: float, t1: float, b: Batch | None, skipped: bool) -> StepStats:
        pool = self.sched.pool
        n_running = self.sched.n_running
        return StepStats(
            index=index,
            start=t0,
            end=t1,
            scheduled_tokens=b.n_tokens if b else n_running,
            num_scheduled_seqs=b.n_seqs if b else n_running,
            num_running=n_running,
            num_waiting=len(self.sched.waiting),
            num_preempted=len(b.preempted) if b else 0,
            num_admitted=len(b.admitted) if b else 0,
            blocks_free_uncached=pool.free_uncached,
            blocks_cached_evictable=len(pool.evictable),
            blocks_used=self.sched.private_blocks_running() + len(pool.refs),
            blocks_total=pool.num_gpu_blocks - 1,
            skipped_ahead=skipped,
        )

    def _skip_ahead(self, t: float) -> bool:
        """Run a stretch of pure-decode steps in one go; False when no stretch of 2+ fits."""
        sched = self.sched
        pending = self._pending
        if pending and pending[0][0] <= self.now and not sched.waiting:
            d = sched.n_running
            if d < sched.mns and d < sched.budget:
                return False  # an arrival would join the second step (see below)
        k = sched.decode_stretch_limit()
        if k < 2:
            return False
        d = sched.n_running
        ctx0 = float(sched.decode_ctx())
        dts = self.steptime.decode_times(d, ctx0, k)
        if self.reality.step_jitter > 0:
            dts = dts * self._jitter(sched.step_index, k)
        ends = np.cumsum(np.concatenate(([self.now], dts)))
        starts = ends[:-1]
        ends = ends[1:]
        limit = t
        if self._crash_at is not None:
            limit = min(limit, self._crash_at)
        if self._drain_deadline is not None:
            limit = min(limit, self._drain_deadline)
        k = min(k, int(np.searchsorted(starts, limit, side="left")))
        # An arrival can join this stretch's steps only if step 2 could admit it. It is seen
        # by the first step starting at or after it, or (async scheduling) by the first step
        # whose predecessor started at or after it.
        if self._pending and not sched.waiting and d < sched.mns and d < sched.budget:
            seen = int(np.searchsorted(starts, self._pending[0][0], side="left"))
            k = min(k, seen + 1 if self.config.async_scheduling else seen)
        if k < 2:
            return False
        dts = dts[:k]
        ends = ends[:k]
        s0 = sched.step_index
        gap, n_regular, odd = sched.commit_decode_stretch(ends)
        m = self.metrics
        m.observe_itl_repeated(gap, n_regular)
        if odd:
            m.observe_itl(np.asarray(odd))
        m.itl.observe_many_weighted(dts[1:], d)
        if "vllm:time_per_output_token_seconds" in m.hidden:
            m.tpot_old.observe_many_weighted(dts[1:], d)
        m.generation_tokens.inc(k * d)
        m.iteration_tokens.observe_repeated(d, k)
        prev = self.now
        self.now = float(ends[-1])
        self._prev_start = float(starts[k - 1])
        self._prev_end = self.now
        if self.on_step is not None:
            for i in range(k):
                start = prev if i == 0 else float(ends[i - 1])
                self.on_step(self._stats(s0 + i, start, float(ends[i]), None, True))
        # Arrivals that came during the stretch join the queue behind the blocked head.
        return True

    # ---- finishing --------------------------------------------------------------------------

    def _finish(self, seq: Seq, reason: str, t: float) -> None:
        itl: list[float] = []
        first = seq.first_token_time
        if self.record_itl and first is not None:
            times = self.sched.token_times(seq)
            itl = (times[1:] - times[:-1]).tolist()
        out_len = seq.ntok - seq.plen
        arrival = seq.arrival
        rec = RequestRecord(
            seq.rid, arrival, seq.plen, out_len, seq.max_tokens, seq.first_scheduled, first, t,
            reason, seq.cached_tokens, seq.num_preemptions, itl,
        )  # fmt: skip
        self._finished.append(rec)
        self._ids.discard(seq.rid)  # only in-flight ids must be unique
        sched_t = seq.first_scheduled
        if sched_t is None:
            sched_t = t
        if first is None:
            first = last = t
            tpot = 0.0
        else:
            last = float(self.sched._times[seq.last_step])
            tpot = (t - first) / (out_len - 1) if out_len > 1 else 0.0
        queue = sched_t - seq.queued_at
        m = self.metrics
        success = m.request_success.values
        success[reason] = success.get(reason, 0.0) + 1
        m.finished_rows.append(
            (t - arrival, queue if queue > 0.0 else 0.0, first - sched_t, last - first,
             last - sched_t, tpot, seq.plen, out_len, out_len, seq.max_tokens, 1,
             seq.plen - seq.cached_tokens, seq.num_preemptions)
        )  # fmt: skip
        if len(m.finished_rows) >= 4096:
            m.flush()

    # ---- introspection ------------------------------------------------------------------------

    def _gauges(self) -> tuple[int, int, float]:
        return self.sched.n_running, len(self.sched.waiting), self.sched.pool.usage()

    def _cache_config_fields(self) -> list[tuple[str, object]]:
        """CacheConfig.__dict__ of vLLM 0.33 in declaration order (vLLM config/cache.py). Fields the
        simulator does not model carry vLLM's defaults."""
        c, kv = self.resolved, self.kv
        return [
            ("block_size", c.block_size),
            ("user_specified_block_size", c.block_size != 16),
            ("kv_cache_layout", None),
            ("prefix_match_unit", None),
            ("gpu_memory_utilization", c.gpu_memory_utilization),
            ("cache_dtype", c.kv_cache_dtype),
            ("is_attention_free", False),
            ("num_gpu_blocks_override", c.num_gpu_blocks_override),
            ("sliding_window", None),
            ("enable_prefix_caching", c.enable_prefix_caching),
            ("prefix_caching_hash_algo", "sha256"),
            ("prefix_cache_retention_interval", None),
            ("kv_cache_dtype_skip_layers", []),
            ("mamba_page_size_padded", None),
            ("skip_page_size_padded", None),
            ("mamba_block_size", None),
            ("mamba_cache_dtype", "auto"),
            ("mamba_ssm_cache_dtype", "auto"),
            ("mamba_cache_mode", "none"),
            ("enable_mamba_shared_prefix_checkpoint", False),
            ("replayssm_buffer_len", None),
            ("use_replayssm", False),
            ("use_kda_recoverssm", False),
            ("num_gpu_blocks", kv.num_gpu_blocks),
            ("num_cpu_blocks", None),
            ("simple_cpu_offload_num_blocks", None),
            ("effective_attention_block_size", c.block_size),
            ("kv_cache_size_tokens", kv.kv_cache_size_tokens),
            ("kv_cache_max_concurrency", round(kv.max_concurrency, 2)),
            ("hash_block_size", c.block_size),
            ("cache_hit_alignment_tokens", None),
            ("kv_sharing_fast_prefill", False),
            ("swa_bounded_replay", False),
            ("kv_cache_memory_bytes", None),
            ("kv_offloading_size", None),
            ("kv_offloading_backend", "native"),
        ]


__all__ = ["Engine", "EngineCrashed", "KVCacheInfo", "StartupError", "StepStats"]
