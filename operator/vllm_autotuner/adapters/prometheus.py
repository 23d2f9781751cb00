"""Read one Snapshot per VLLMDeployment from Prometheus, for every deployment in one cycle.

The operator asks for all its deployments at once (`PrometheusSource.snapshots`), so the number
of HTTP queries per cycle is (#signals x #distinct windows), never the number of deployments:
the query text and the assembly live in `adapters.promql` (pure); this module only moves bytes.

Two transports share that code: aiohttp for the operator (it runs in kopf's event loop), and
prometheus-api-client for the synchronous `vllm-autotuner recommend` CLI.

Failure is data, not an exception: a dead or slow Prometheus (bounded by `timeout_s`), an HTTP
error, an empty answer or a NaN turns into `Snapshot.unavailable(reason)` for the deployments it
touches, or into a None field, so one bad cycle never crashes a reconcile. The bearer token is
read from its file on every request (projected service-account tokens rotate) and never logged.
"""

from __future__ import annotations

import asyncio
import logging
import ssl
import time
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import replace
from datetime import UTC, datetime, timedelta
from typing import Any, Protocol
from urllib.parse import urlsplit, urlunsplit

import aiohttp

from vllm_autotuner.adapters.answers import (
    ANSWER_MAX_BYTES,
    READ_CHUNK,
    SAMPLES_PER_POD,
    AnswerLimits,
    AnswerRefused,
    Inflater,
    check_values,
    decode,
)
from vllm_autotuner.adapters.promql import (
    DISCOVERY_MATCH,
    REQUIRED_SIGNAL,
    MetricNames,
    QueryFailure,
    QueryOutcome,
    Sample,
    Selector,
    SnapshotTarget,
    assemble,
    build_queries,
    discovery_query_for_targets,
    effective_window,
    index_outcomes,
    label_name,
    last_seen_query,
    parse_vector,
    resolve_names,
)
from vllm_autotuner.core.snapshot import Snapshot
from vllm_autotuner.core.tuning_types import SLOTarget

__all__ = [
    "PrometheusError",
    "PrometheusQueryError",
    "PrometheusSource",
    "PrometheusUnreachable",
    "SnapshotTarget",
]

log = logging.getLogger(__name__)

# How far back name discovery looks: long enough to see every live exporter, short enough that
# names of a vLLM version replaced days ago no longer win.
DISCOVERY_LOOKBACK = timedelta(hours=1)
ASSEMBLE_INLINE_MAX = 50  # deployments assembled on the event loop; more go to a thread


class PrometheusError(Exception):
    """Prometheus could not answer (base class; messages never contain credentials)."""


class PrometheusUnreachable(PrometheusError):
    """No HTTP answer in time: connection refused, DNS, TLS, timeout, or a 5xx from a proxy."""


class PrometheusQueryError(PrometheusError):
    """Prometheus answered but refused the request (bad query, 4xx, unreadable token)."""


class _Transport(Protocol):
    async def query(self, expr: str, at: float) -> Any: ...

    async def label_values(self, label: str, match: str, start: float, end: float) -> Any: ...


MAX_ERROR_TEXT = 300  # of a server's error message, quoted in logs, status and Events


def _error_text(body: Any, status: int) -> str:
    if isinstance(body, dict) and body.get("error"):
        kind = str(body.get("errorType", "error"))[:40]
        return f"HTTP {status}: {kind}: {str(body['error'])[:MAX_ERROR_TEXT]}"
    return f"HTTP {status}"


ACCEPT_ENCODING = "gzip, deflate"  # the encodings Inflater decodes with a budget


def _unwrap(status: int, body: Any) -> Any:
    """`data` of a successful answer; the error an unsuccessful one stands for."""
    if status >= 500 and not (isinstance(body, dict) and body.get("status") == "error"):
        raise PrometheusUnreachable(_error_text(body, status))
    if status != 200 or not isinstance(body, dict) or body.get("status") != "success":
        raise PrometheusQueryError(_error_text(body, status))
    return body.get("data")


class _AiohttpTransport:
    """POST form queries: a batched pod regex can be far longer than a URL should be.

    The whole exchange (connect, headers, body) has `timeout_s`, and the body is read within
    `limits` (adapters.answers): a slow or huge answer costs the budget, never more.
    """

    def __init__(
        self,
        session: aiohttp.ClientSession,
        url: str,
        timeout_s: float,
        headers: Callable[[], dict[str, str]],
        ssl_context: ssl.SSLContext | None,
    ) -> None:
        self._session = session
        self._url = url
        self._timeout_s = timeout_s
        self._timeout = aiohttp.ClientTimeout(total=timeout_s)
        self._server_timeout = f"{max(1.0, timeout_s):.0f}s"
        self._headers = headers
        self._ssl: ssl.SSLContext | bool = ssl_context if ssl_context is not None else True
        self.limits = AnswerLimits.for_pods(0)

    async def _call(self, method: str, path: str, form: list[tuple[str, str]]) -> Any:
        headers = {**self._headers(), "Accept-Encoding": ACCEPT_ENCODING}
        limits = self.limits
        try:
            async with asyncio.timeout(self._timeout_s):
                status, raw = await self._exchange(method, path, form, headers, limits)
        except TimeoutError as exc:
            raise PrometheusUnreachable(
                f"no answer within {self._timeout_s:g}s ({type(exc).__name__})"
            ) from exc
        except (aiohttp.ClientError, OSError) as exc:
            raise PrometheusUnreachable(f"{type(exc).__name__}: {exc}") from exc
        except AnswerRefused as exc:
            raise PrometheusQueryError(f"answer refused: {exc}") from None
        try:
            body = decode(raw, limits)
        except AnswerRefused as exc:
            raise PrometheusQueryError(f"answer refused: {exc}") from None
        del raw
        return _unwrap(status, body)

    async def _exchange(
        self,
        method: str,
        path: str,
        form: list[tuple[str, str]],
        headers: dict[str, str],
        limits: AnswerLimits,
    ) -> tuple[int, bytearray]:
        async with self._session.request(
            method,
            f"{self._url}{path}",
            data=form if method == "POST" else None,
            params=form if method == "GET" else None,
            headers=headers,
            timeout=self._timeout,
            ssl=self._ssl,
        ) as resp:
            if resp.content_length is not None and resp.content_length > limits.max_bytes:
                raise AnswerRefused(
                    f"the answer announces {resp.content_length} bytes, more than the "
                    f"{limits.max_bytes} this query can need"
                )
            inflater = Inflater(resp.headers.get("Content-Encoding"), limits.max_bytes)
            wire = 0
            async for chunk in resp.content.iter_chunked(READ_CHUNK):
                wire += len(chunk)
                if wire > limits.max_bytes:
                    raise AnswerRefused(f"the answer is larger than {limits.max_bytes} bytes")
                inflater.feed(chunk)
            return resp.status, inflater.finish()

    async def query(self, expr: str, at: float) -> Any:
        form = [("query", expr), ("time", f"{at:.3f}"), ("timeout", self._server_timeout)]
        data = await self._call("POST", "/api/v1/query", form)
        return data.get("result") if isinstance(data, dict) else None

    async def label_values(self, label: str, match: str, start: float, end: float) -> Any:
        form = [("match[]", match), ("start", f"{start:.3f}"), ("end", f"{end:.3f}")]
        return await self._call("GET", f"/api/v1/label/{label}/values", form)


class _ApiClientTransport:
    """prometheus-api-client (requests) in worker threads, for the synchronous CLI path.

    The session's adapter for the Prometheus URL reads every body within the same budget and
    deadline as the aiohttp transport (adapters.answers), before prometheus-api-client parses
    it: requests would otherwise read and inflate it whole.
    """

    def __init__(
        self,
        url: str,
        timeout_s: float,
        headers: Callable[[], dict[str, str]],
        ca_file: str | None,
    ) -> None:
        import requests
        from prometheus_api_client import PrometheusConnect
        from urllib3.util.retry import Retry

        session = requests.Session()
        if ca_file is not None:
            session.verify = ca_file
        # No retries: a cycle is retried by the next reconcile, and retries would break the
        # timeout_s bound the caller relies on.
        self._pc = PrometheusConnect(
            url=url, session=session, retry=Retry(total=0), timeout=timeout_s, method="POST"
        )
        self.limits = AnswerLimits.for_pods(0)
        # PrometheusConnect mounts its own adapter on the URL; ours replaces it.
        session.mount(url, _bounded_adapter(lambda: self.limits, timeout_s))
        self._timeout = timeout_s
        self._headers = headers
        self._requests_errors: tuple[type[BaseException], ...] = (
            requests.exceptions.ConnectionError,
            requests.exceptions.Timeout,
        )

    async def _run(self, fn: Callable[[], Any]) -> Any:
        from prometheus_api_client.exceptions import PrometheusApiClientException

        def call() -> Any:
            self._pc.headers = {**self._headers(), "Accept-Encoding": ACCEPT_ENCODING}
            return fn()

        try:
            return await asyncio.to_thread(call)
        except AnswerRefused as exc:
            raise PrometheusQueryError(f"answer refused: {exc}") from None
        except self._requests_errors as exc:
            raise PrometheusUnreachable(f"{type(exc).__name__}: {exc}") from exc
        except PrometheusApiClientException as exc:
            text = str(exc)
            if "HTTP Status Code 5" in text:
                raise PrometheusUnreachable(text[:300]) from exc
            raise PrometheusQueryError(text[:300]) from exc
        except (ValueError, KeyError, TypeError) as exc:  # a non-JSON or odd answer
            raise PrometheusQueryError(f"unexpected answer: {type(exc).__name__}") from exc

    async def query(self, expr: str, at: float) -> Any:
        params = {"time": f"{at:.3f}", "timeout": f"{max(1.0, self._timeout):.0f}s"}
        return await self._run(lambda: self._pc.custom_query(expr, params=params))

    async def label_values(self, label: str, match: str, start: float, end: float) -> Any:
        params = {"match[]": match, "start": f"{start:.3f}", "end": f"{end:.3f}"}
        return await self._run(lambda: self._pc.get_label_values(label, params=params))


def _bounded_adapter(limits: Callable[[], AnswerLimits], timeout_s: float) -> Any:
    """A requests adapter that reads each body within `limits()` and `timeout_s` in all."""
    import requests
    from requests.adapters import HTTPAdapter
    from urllib3.util.retry import Retry

    class BoundedAdapter(HTTPAdapter):
        def send(self, request: Any, *args: Any, **kwargs: Any) -> Any:
            deadline = time.monotonic() + timeout_s
            kwargs["stream"] = True
            response = super().send(request, *args, **kwargs)
            try:
                budget = limits()
                raw = _read_bounded(response.raw, response.headers, budget, deadline)
                check_values(raw, budget)  # before prometheus-api-client parses it
            finally:
                response.close()
            response._content = bytes(raw)
            response._content_consumed = True
            response.headers.pop("Content-Encoding", None)
            return response

    def _read_bounded(
        raw: Any, headers: Mapping[str, str], budget: AnswerLimits, deadline: float
    ) -> bytearray:
        inflater = Inflater(headers.get("Content-Encoding"), budget.max_bytes)
        wire = 0
        while True:
            if time.monotonic() > deadline:
                raise requests.exceptions.Timeout(f"no whole answer within {timeout_s:g}s")
            chunk = (
                raw.read1(READ_CHUNK, decode_content=False)
                if hasattr(raw, "read1")
                else (raw.read(READ_CHUNK, decode_content=False))
            )
            if not chunk:
                return inflater.finish()
            wire += len(chunk)
            if wire > budget.max_bytes:
                raise AnswerRefused(f"the answer is larger than {budget.max_bytes} bytes")
            inflater.feed(chunk)

    return BoundedAdapter(max_retries=Retry(total=0))


class PrometheusSource:
    """Snapshots for many deployments per cycle, with a bounded number of queries.

    `rate_scale` is the virtual seconds per wall second of a simulated fleet (vllm-sim
    --sim-time-scale): rates PromQL computes per wall second are divided by it; latencies are
    recorded in virtual seconds already and are left alone. 1.0 for real vLLM.

    `min_window_s` is the shortest window worth judging (at least two scrape intervals; a
    minute by default), `window_grid_s` the granularity windows are rounded down to, so that
    deployments of similar age share queries. `last_cycle_queries` counts the HTTP requests of
    the latest cycle (discovery included), `total_queries` all of them.
    """

    def __init__(
        self,
        url: str,
        *,
        timeout_s: float = 10,
        bearer_token_file: str | None = None,
        ca_file: str | None = None,
        rate_scale: float = 1.0,
        min_window_s: float = 60.0,
        window_grid_s: float = 15.0,
        rediscover_every_s: float = 600.0,
        rediscover_on_empty_s: float = 30.0,
        max_concurrency: int = 8,
        namespace_label: str = "namespace",
        pod_label: str = "pod",
    ) -> None:
        if rate_scale <= 0:
            raise ValueError("rate_scale must be positive")
        self.url = url.rstrip("/")
        # What messages, logs and status may show: the URL without user:password@.
        self.display_url = _without_userinfo(self.url)
        self.timeout_s = float(timeout_s)
        self.bearer_token_file = bearer_token_file
        self.ca_file = ca_file
        self.rate_scale = float(rate_scale)
        self.min_window_s = float(min_window_s)
        self.window_grid_s = float(window_grid_s)
        self.rediscover_every_s = float(rediscover_every_s)
        self.rediscover_on_empty_s = float(rediscover_on_empty_s)
        self.max_concurrency = max(1, int(max_concurrency))
        self.namespace_label = label_name(namespace_label)
        self.pod_label = label_name(pod_label)
        self.names: MetricNames | None = None
        self._discovered_at: float | None = None  # time.monotonic()
        self._names_suspect = False
        self.last_cycle_queries = 0
        self.total_queries = 0
        self._cycle_queries = 0

    # ------------------------------------------------------------------------ public API

    async def snapshots(
        self, targets: Sequence[SnapshotTarget], now: datetime
    ) -> dict[tuple[str, str], Snapshot]:
        """One Snapshot per target, keyed by (namespace, name); never raises for I/O trouble."""
        try:
            async with self._session() as transport:
                results = await self._cycle(transport, targets, now)
            return {key: self._redacted(snap) for key, snap in results.items()}
        except (OSError, ssl.SSLError, ValueError) as exc:  # e.g. an unreadable CA bundle
            log.warning(
                "cannot query Prometheus at %s: %s", self.display_url, self.redact(str(exc))
            )
            reason = f"cannot query Prometheus at {self.display_url}: {type(exc).__name__}: {exc}"
        except Exception as exc:
            # A bug here must not stop the reconcile of every deployment: say so and go on.
            log.exception("Prometheus snapshot cycle failed")
            reason = f"internal error reading Prometheus: {type(exc).__name__}: {exc}"
        reason = self.redact(reason)
        return {t.key: Snapshot.unavailable(now, t.window_s, reason) for t in targets}

    def redact(self, text: str) -> str:
        """`text` without the credentials this source sends (a server may echo them back)."""
        text = text.replace(self.url, self.display_url)
        for secret in self._secrets():
            text = text.replace(secret, "[REDACTED]")
        return text

    def _redacted(self, snap: Snapshot) -> Snapshot:
        return snap if not snap.reason else replace(snap, reason=self.redact(snap.reason))

    def _secrets(self) -> list[str]:
        found = []
        parts = urlsplit(self.url)
        if parts.password:
            found.append(parts.password)
        if self.bearer_token_file is not None:
            try:
                with open(self.bearer_token_file, encoding="utf-8") as f:
                    token = f.read().strip()
            except OSError:
                token = ""
            if len(token) >= 4:  # never "redact" every single letter of a message
                found.append(token)
        return found

    def snapshots_sync(
        self, targets: Sequence[SnapshotTarget], now: datetime | None = None
    ) -> dict[tuple[str, str], Snapshot]:
        """`snapshots` through prometheus-api-client, for callers without an event loop."""
        when = now or datetime.now(UTC)
        return asyncio.run(self._cycle(self._api_client(), targets, when))

    async def discover_targets(
        self,
        namespace: str | None = None,
        pod_regex: str | None = None,
        labels: Mapping[str, str] | None = None,
        *,
        window_s: float = 300.0,
        slo: tuple[SLOTarget | None, SLOTarget | None, SLOTarget | None] = (None, None, None),
        now: datetime | None = None,
    ) -> list[SnapshotTarget]:
        """vLLM pods Prometheus saw lately, one target per (namespace, served model).

        For `recommend` without a Kubernetes API: pods, revision and knobs are unknown, so
        `since`, `knobs` and `revision` are None. Raises PrometheusError when Prometheus cannot
        answer (a CLI wants to say so, not to print nothing).
        """
        async with self._session() as transport:
            return await self._discover_targets(
                transport, namespace, pod_regex, labels, window_s, slo, now
            )

    def discover_targets_sync(
        self,
        namespace: str | None = None,
        pod_regex: str | None = None,
        labels: Mapping[str, str] | None = None,
        *,
        window_s: float = 300.0,
        slo: tuple[SLOTarget | None, SLOTarget | None, SLOTarget | None] = (None, None, None),
        now: datetime | None = None,
    ) -> list[SnapshotTarget]:
        return asyncio.run(
            self._discover_targets(
                self._api_client(), namespace, pod_regex, labels, window_s, slo, now
            )
        )

    def last_seen_sync(
        self, namespace: str, pods: Sequence[str], window_s: float, now: datetime
    ) -> datetime | None:
        """When any of `pods` last exported vLLM metrics within the window (`recommend`)."""
        names = self.names.spellings("running") if self.names is not None else ()
        if not names or not pods:
            return None
        expr = last_seen_query(
            names, namespace, pods, int(max(1.0, window_s)), self.namespace_label, self.pod_label
        )
        samples = parse_vector(
            asyncio.run(self._counted(self._api_client().query(expr, now.timestamp())))
        )
        return datetime.fromtimestamp(samples[0].value, UTC) if samples else None

    # ------------------------------------------------------------------------- transports

    def _headers(self) -> dict[str, str]:
        if self.bearer_token_file is None:
            return {}
        try:
            with open(self.bearer_token_file, encoding="utf-8") as f:
                token = f.read().strip()
        except OSError as exc:
            raise PrometheusQueryError(
                f"cannot read bearer token file {self.bearer_token_file}: {exc.strerror}"
            ) from None
        return {"Authorization": f"Bearer {token}"} if token else {}

    def _ssl_context(self) -> ssl.SSLContext | None:
        if self.ca_file is None or not self.url.startswith("https:"):
            return None
        return ssl.create_default_context(cafile=self.ca_file)

    def _session(self) -> _SessionScope:
        return _SessionScope(self)

    def _api_client(self) -> _ApiClientTransport:
        return _ApiClientTransport(self.url, self.timeout_s, self._headers, self.ca_file)

    async def _counted(self, call: Awaitable[Any]) -> Any:
        self._cycle_queries += 1
        self.total_queries += 1
        return await call

    # ------------------------------------------------------------------------------ cycle

    async def _discover(self, transport: _Transport, now: datetime) -> MetricNames:
        start = (now - DISCOVERY_LOOKBACK).timestamp()
        data = await self._counted(
            transport.label_values("__name__", DISCOVERY_MATCH, start, now.timestamp())
        )
        available = [str(n) for n in data] if isinstance(data, list) else []
        names = resolve_names(available)
        if self.names is None or dict(names.names) != dict(self.names.names):
            log.info("Prometheus %s: vLLM metric names %s", self.display_url, dict(names.names))
        self.names = names
        self._discovered_at = time.monotonic()
        self._names_suspect = False
        return names

    def _discovery_due(self) -> bool:
        if self.names is None or self._discovered_at is None:
            return True
        age = time.monotonic() - self._discovered_at
        if age >= self.rediscover_every_s:
            return True
        if not self.names.get(REQUIRED_SIGNAL) or self._names_suspect:
            return age >= self.rediscover_on_empty_s
        return False

    async def _names_for_cycle(self, transport: _Transport, now: datetime) -> MetricNames:
        if self._discovery_due() or self.names is None:
            try:
                return await self._discover(transport, now)
            except PrometheusQueryError:
                if self.names is not None:  # keep the names we had; try again next time
                    return self.names
                raise
        return self.names

    async def _cycle(
        self, transport: _Transport, targets: Sequence[SnapshotTarget], now: datetime
    ) -> dict[tuple[str, str], Snapshot]:
        self._cycle_queries = 0
        try:
            return await self._cycle_inner(transport, targets, now)
        finally:
            self.last_cycle_queries = self._cycle_queries

    async def _cycle_inner(
        self, transport: _Transport, targets: Sequence[SnapshotTarget], now: datetime
    ) -> dict[tuple[str, str], Snapshot]:
        out: dict[tuple[str, str], Snapshot] = {}
        groups: dict[int, list[SnapshotTarget]] = {}
        for t in targets:
            if not t.pods:
                out[t.key] = Snapshot.unavailable(
                    now, t.window_s, "no ready pods of the current revision", warming_up=True
                )
                continue
            window, why = effective_window(t, now, self.window_grid_s, self.min_window_s)
            if why is not None:
                out[t.key] = Snapshot.unavailable(now, t.window_s, why, warming_up=True)
                continue
            groups.setdefault(window, []).append(t)
        if not groups:
            return out

        def fail_all(reason: str) -> dict[tuple[str, str], Snapshot]:
            for w, ts in groups.items():
                for t in ts:
                    out[t.key] = Snapshot.unavailable(now, w, reason)
            return out

        _set_limits(transport, AnswerLimits.for_pods(0))
        try:
            names = await self._names_for_cycle(transport, now)
        except PrometheusUnreachable as exc:
            log.warning("Prometheus unreachable at %s: %s", self.display_url, self.redact(str(exc)))
            return fail_all(f"Prometheus unreachable at {self.display_url}: {exc}")
        except PrometheusQueryError as exc:
            return fail_all(
                f"Prometheus at {self.display_url} refused the metric name lookup: {exc}"
            )
        if not names.get(REQUIRED_SIGNAL):
            return fail_all(
                f"no vllm metrics in Prometheus at {self.display_url} in the last "
                f"{DISCOVERY_LOOKBACK.total_seconds() / 3600:g}h (looked for vllm:* and vllm_*)"
            )

        jobs: list[tuple[int, str, str]] = []
        for window, ts in groups.items():
            sel = Selector(
                namespaces=tuple(sorted({t.namespace for t in ts})),
                pods=tuple(sorted({p for t in ts for p in t.pods})),
                namespace_label=self.namespace_label,
                pod_label=self.pod_label,
            )
            for key, expr in build_queries(names, sel, window).items():
                jobs.append((window, key, expr))
        wanted = {(t.namespace, p) for ts in groups.values() for t in ts for p in t.pods}
        _set_limits(transport, AnswerLimits.for_pods(len(wanted)))
        results = await self._run_queries(
            transport, [expr for _, _, expr in jobs], now, frozenset(wanted)
        )
        outcomes: dict[int, dict[str, QueryOutcome]] = {}
        for (window, key, _), outcome in zip(jobs, results, strict=True):
            outcomes.setdefault(window, {})[key] = outcome

        def assemble_all() -> None:
            for window, ts in groups.items():
                indexed = index_outcomes(
                    outcomes.get(window, {}), self.namespace_label, self.pod_label
                )
                for t in ts:
                    snap = self._assemble_one(t, now, window, indexed)
                    if not snap.available and snap.reason.startswith("no vllm metrics"):
                        self._names_suspect = True  # maybe renamed or re-escaped: look again
                    out[t.key] = snap

        # About 1 ms of CPU per deployment: a big fleet would stall kopf's loop for seconds.
        if len(targets) > ASSEMBLE_INLINE_MAX:
            await asyncio.to_thread(assemble_all)
        else:
            assemble_all()
        return out

    def _assemble_one(
        self,
        target: SnapshotTarget,
        now: datetime,
        window: int,
        indexed: Mapping[str, Any],
    ) -> Snapshot:
        """One deployment's Snapshot; a failure here is that deployment's alone."""
        try:
            return assemble(
                target,
                now,
                window,
                indexed,
                rate_scale=self.rate_scale,
                namespace_label=self.namespace_label,
                pod_label=self.pod_label,
            )
        except Exception as exc:  # a bug or a shape we did not foresee: never the whole fleet
            log.exception("metrics of %s/%s could not be read", *target.key)
            reason = f"the metrics of this deployment could not be read ({type(exc).__name__})"
            return Snapshot.unavailable(now, window, reason)

    async def _run_queries(
        self,
        transport: _Transport,
        exprs: Sequence[str],
        now: datetime,
        wanted: frozenset[tuple[str, str]] | None = None,
    ) -> list[QueryOutcome]:
        """All queries concurrently (bounded); after the first sign of a dead server the rest
        are skipped, so a cycle against a dead Prometheus costs about one timeout_s."""
        sem = asyncio.Semaphore(self.max_concurrency)
        dead: list[str] = []
        at = now.timestamp()

        async def one(expr: str) -> QueryOutcome:
            async with sem:
                if dead:
                    return QueryFailure(dead[0], unreachable=True)
                try:
                    result = await self._counted(transport.query(expr, at))
                except PrometheusUnreachable as exc:
                    message = f"Prometheus unreachable at {self.display_url}: {exc}"
                    if not dead:
                        log.warning("%s", self.redact(message))
                        dead.append(message)
                    return QueryFailure(message, unreachable=True)
                except PrometheusQueryError as exc:
                    log.warning(
                        "Prometheus query failed: %s (%s)", self.redact(str(exc)), expr[:200]
                    )
                    return QueryFailure(f"Prometheus query failed: {exc}")
                samples = parse_vector(result)
                del result
                return samples if wanted is None else self._kept(samples, wanted)

        return list(await asyncio.gather(*(one(e) for e in exprs)))

    def _kept(self, samples: list[Sample], wanted: frozenset[tuple[str, str]]) -> list[Sample]:
        """The samples of pods this cycle asked about, at most SAMPLES_PER_POD each: another
        pod's series cost nothing, and one pod's flood of series crowds out no one else."""
        counts: dict[tuple[str, str], int] = {}
        kept = []
        for s in samples:
            key = (s.labels.get(self.namespace_label, ""), s.labels.get(self.pod_label, ""))
            if key in wanted and counts.get(key, 0) < SAMPLES_PER_POD:
                counts[key] = counts.get(key, 0) + 1
                kept.append(s)
        return kept

    async def _discover_targets(
        self,
        transport: _Transport,
        namespace: str | None,
        pod_regex: str | None,
        labels: Mapping[str, str] | None,
        window_s: float,
        slo: tuple[SLOTarget | None, SLOTarget | None, SLOTarget | None],
        now: datetime | None,
    ) -> list[SnapshotTarget]:
        when = now or datetime.now(UTC)
        _set_limits(transport, AnswerLimits.fixed(ANSWER_MAX_BYTES))  # pods unknown here
        names = await self._discover(transport, when)
        running = names.spellings("running")
        if not running:
            return []
        expr = discovery_query_for_targets(
            running,
            namespace,
            pod_regex,
            labels,
            int(max(1.0, window_s)),
            self.namespace_label,
            self.pod_label,
        )
        samples = parse_vector(await self._counted(transport.query(expr, when.timestamp())))
        grouped: dict[tuple[str, str], set[str]] = {}
        for s in samples:
            ns = s.labels.get(self.namespace_label, "")
            pod = s.labels.get(self.pod_label, "")
            if pod:
                grouped.setdefault((ns, s.labels.get("model_name", "")), set()).add(pod)
        return [
            SnapshotTarget(
                namespace=ns,
                name=model or "vllm",
                pods=tuple(sorted(pods)),
                since=None,
                knobs=None,
                revision=None,
                window_s=window_s,
                slo=slo,
                model_name=model or None,
            )
            for (ns, model), pods in sorted(grouped.items())
        ]


def _set_limits(transport: _Transport, limits: AnswerLimits) -> None:
    """Give the transport the budget of the answers to come (test doubles have none)."""
    if isinstance(transport, _AiohttpTransport | _ApiClientTransport):
        transport.limits = limits


class _SessionScope:
    """One aiohttp session per cycle: the operator's loop owns nothing between cycles, so no
    session outlives a loop (kopf restarts, tests with a loop per test)."""

    def __init__(self, source: PrometheusSource) -> None:
        self._source = source
        self._session: aiohttp.ClientSession | None = None

    async def __aenter__(self) -> _AiohttpTransport:
        src = self._source
        # Bodies are inflated by adapters.answers, within their budget, never by aiohttp.
        self._session = aiohttp.ClientSession(auto_decompress=False)
        return _AiohttpTransport(
            self._session, src.url, src.timeout_s, src._headers, src._ssl_context()
        )

    async def __aexit__(self, *exc: object) -> None:
        if self._session is not None:
            await self._session.close()


def _without_userinfo(url: str) -> str:
    parts = urlsplit(url)
    if parts.username is None and parts.password is None:
        return url
    host = parts.hostname or ""
    if ":" in host:  # IPv6 literal
        host = f"[{host}]"
    netloc = host if parts.port is None else f"{host}:{parts.port}"
    return urlunsplit((parts.scheme, netloc, parts.path, parts.query, parts.fragment))
