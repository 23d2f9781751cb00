"""kopf wiring only: gather inputs from kopf's indexes, call the controller, post events.

Handlers are registered on a registry built per operator instance (`build_registry`), so the
reconcile interval and the clients come from the command line, and tests can run several
operators in one process without sharing global state.
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime
import json
import logging
import os
import sys
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, cast

import kopf

from vllm_autotuner import (
    API_VERSION,
    DEPLOYMENT_LABEL,
    FIELD_MANAGER,
    GROUP,
    MANAGED_BY_LABEL,
    MANAGED_BY_VALUE,
    VERSION,
)
from vllm_autotuner.adapters.kube import KubeClient, KubeCredentials, KubeError, resource_path
from vllm_autotuner.adapters.metrics import OperatorMetrics
from vllm_autotuner.adapters.prometheus import PrometheusSource
from vllm_autotuner.controller import (
    Controller,
    Outcome,
    PackedChild,
    packed_copy,
    policy_status_patch,
)
from vllm_autotuner.core.perf_model import AnalyticModel, EngineModel, PerformanceModel
from vllm_autotuner.core.render import CANARY_SUFFIX, TRACK_LABEL
from vllm_autotuner.core.tuning_types import DeploymentContext
from vllm_autotuner.observer import Observer, SnapshotSource
from vllm_autotuner.periodic import ReconcileSchedule, run_periodic

log = logging.getLogger(__name__)

DEPLOYMENTS = "vllmdeployments"
# How long kopf keeps a token read from a file before it asks `login` again. The kubelet
# refreshes a projected token at 80% of its lifetime (an hour by default), so the old one stays
# valid for at least twelve minutes after a rotation.
LOGIN_TTL = datetime.timedelta(minutes=5)
POLICIES = "vllmtuningpolicies"


@dataclass(frozen=True)
class OperatorConfig:
    """What `vllm-autotuner run` was told; everything has a production default."""

    credentials: KubeCredentials
    reconcile_interval_s: float = 30.0
    request_timeout_s: float = 30.0
    prometheus_url: str | None = None
    prometheus_timeout_s: float = 10.0
    prometheus_bearer_token_file: str | None = None
    prometheus_ca_file: str | None = None
    prometheus_rate_scale: float = 1.0  # only for simulated fleets (vllm-sim --sim-time-scale)
    prometheus_min_window_s: float = 60.0
    metrics_port: int | None = None
    performance_model: str = "analytic"  # or "engine": vllm-sim's engine, CPU-heavier
    standalone: bool = True
    peering_name: str | None = None
    priority: int = 0  # peering priority; distinct per replica or kopf pauses them all
    extra: Mapping[str, Any] = field(default_factory=dict)


def connection_info(credentials: KubeCredentials) -> kopf.ConnectionInfo:
    """kopf's connection from the library's configuration, with the token as of now.

    A token that can change (the pod's rotated service-account token, a kubeconfig token file,
    an exec plugin's expiring credential) expires for kopf after LOGIN_TTL, so kopf logs in
    again and its watches use the fresh one too; a refused token (401) makes kopf log in again
    at once.
    """
    cfg = credentials.configuration
    scheme, token = credentials.authorization()
    now = datetime.datetime.now(datetime.UTC)
    return kopf.ConnectionInfo(
        server=cfg.host,
        scheme=scheme,
        token=token,
        expiration=now + LOGIN_TTL if credentials.rotating else None,
        ca_path=cfg.ssl_ca_cert,
        certificate_path=cfg.cert_file,
        private_key_path=cfg.key_file,
        insecure=not cfg.verify_ssl,
        proxy_url=cfg.proxy,
        default_namespace="default",
    )


# The API server's JSON decoder refuses documents nested deeper than this (encoding/json and
# sigs.k8s.io/json, maxNestingDepth), so no object it stores or serves is deeper.
API_SERVER_MAX_JSON_DEPTH = 10_000
# Python's C JSON decoder spends one recursion level per nesting level, and the handlers and
# copies around it up to two more: room for the deepest object the API server can serve.
RECURSION_LIMIT = 3 * API_SERVER_MAX_JSON_DEPTH + 2_000
UNDECODABLE = "UNDECODABLE"  # an event type kopf does not know: it logs and skips the event


def allow_api_server_depth() -> None:
    """Let this process decode any object the API server can serve.

    Python's default limit (1000) makes kopf's watch fail to decode an object nested a few
    thousand levels deep (a free-form field of an old CRD, another API server); the watcher's
    exception then stops the whole operator, for every tenant, for as long as the object exists.
    """
    if sys.getrecursionlimit() < RECURSION_LIMIT:
        sys.setrecursionlimit(RECURSION_LIMIT)


class TolerantJSON:
    """The ``json`` kopf's watch stream decodes each event line with.

    A line that cannot be decoded (truncated by a proxy, not JSON, deeper than any limit)
    becomes an event of a type kopf does not know, which kopf logs and skips; without this the
    exception ends kopf's watcher and the operator with it. Only that one event is lost: the
    object is read again at the next re-list, and the others keep flowing.
    """

    @staticmethod
    def loads(text: str | bytes) -> Any:
        try:
            return json.loads(text)
        except (ValueError, RecursionError, MemoryError) as exc:
            log.error(
                "skipped a watch event that cannot be decoded (%s, %d bytes)",
                type(exc).__name__,
                len(text),
            )
            return {"type": UNDECODABLE, "object": {}}

    dumps = staticmethod(json.dumps)


def tolerate_undecodable_watch_events() -> bool:
    """Route kopf's watch-stream decoding through TolerantJSON; False if kopf changed shape."""
    try:
        from kopf._cogs.clients import api as kopf_api
    except ImportError:  # pragma: no cover - kopf moved its internals
        log.warning("kopf's watch stream could not be hardened; relying on the depth limit")
        return False
    if getattr(kopf_api, "json", None) is not json and not isinstance(
        getattr(kopf_api, "json", None), TolerantJSON
    ):
        log.warning("kopf's watch stream could not be hardened; relying on the depth limit")
        return False
    setattr(kopf_api, "json", TolerantJSON())  # noqa: B010 - kopf does not export it
    return True


def _child_key(namespace: str | None, name: str | None) -> str:
    return f"{namespace}/{name}"


def _first(index: Any, key: Any) -> Any:
    """kopf indexes hold a collection of values per key; we key by identity, so take one."""
    try:
        values = index[key]
    except KeyError:
        return None
    for value in values:
        return _unpacked(value)
    return None


def model_factory(config: OperatorConfig) -> Callable[[DeploymentContext], PerformanceModel]:
    if config.performance_model == "engine":
        return lambda _ctx: EngineModel()
    return lambda ctx: AnalyticModel(ctx.gpu_product)


# What a reconcile may fail with that the next attempt can fix: API errors (409 conflicts,
# 5xx, 429), an unreachable API server (KubeError with status 0) and timeouts.
RETRIABLE = (KubeError, TimeoutError)
# The most reconciles that run at once (the periodic loop's own limit is the same).
RECONCILES_IN_FLIGHT = 16


def retry_delay(failures: int, interval_s: float) -> float:
    """Seconds before retrying a reconcile that failed `failures` times in a row.

    kopf's default for a failed handler is a flat 60 s, which leaves a 409 unresolved for a
    minute; doubling from a quarter of the interval (at most 1 s) retries a conflict at once
    with fresh state, backs off from a struggling API server, and never waits longer than
    the reconcile interval itself.
    """
    base = min(1.0, interval_s / 4)
    return float(min(interval_s, base * 2 ** max(0, min(failures, 30) - 1)))


def _all(index: Any, key: Any) -> list[Any]:
    try:
        return [_unpacked(v) for v in index[key]]
    except KeyError:
        return []


def _unpacked(value: Any) -> Any:
    return value.unpack() if isinstance(value, PackedChild) else value


def build_registry(
    config: OperatorConfig, snapshot_source: SnapshotSource | None = None
) -> tuple[kopf.OperatorRegistry, Controller]:
    """`snapshot_source` replaces Prometheus (tests and the virtual-time benchmark)."""
    registry = kopf.OperatorRegistry()
    kube = KubeClient(config.credentials, timeout_s=config.request_timeout_s)
    source: SnapshotSource | None = snapshot_source or (
        PrometheusSource(
            config.prometheus_url,
            timeout_s=config.prometheus_timeout_s,
            bearer_token_file=config.prometheus_bearer_token_file,
            ca_file=config.prometheus_ca_file,
            rate_scale=config.prometheus_rate_scale,
            min_window_s=config.prometheus_min_window_s,
        )
        if config.prometheus_url
        else None
    )
    observer = Observer(source, max_age_s=max(300.0, 5 * config.reconcile_interval_s))
    metrics = OperatorMetrics()
    controller = Controller(
        kube, observer=observer, metrics=metrics, model_factory=model_factory(config)
    )
    stop_observing = asyncio.Event()
    background: list[asyncio.Task[None]] = []
    periodic: list[asyncio.Task[None]] = []
    failures: dict[str, int] = {}  # consecutive failed reconciles per object, for backoff
    # Reconciles in flight at once, whatever started them (the periodic loop, a new or
    # changed VLLMDeployment, a child's event). kopf calls the event handlers of every object
    # at once: at start-up, 1,000 VLLMDeployments were 1,000 reconciles rendering, applying
    # and deciding together, and the heap they grew stayed with the process (docs/scale.md).
    in_flight = asyncio.Semaphore(RECONCILES_IN_FLIGHT)
    # Standalone mode: event handlers hand their deployment to the periodic loop (due now)
    # and return, instead of waiting for a reconcile slot inside kopf's per-object worker.
    # Waiting there, each event held kopf's whole processing of it (the object, its patch,
    # loggers and handler frames): at start-up 3,300 workers and 12,700 coroutines, a peak
    # of 177 MiB of live Python objects whose arenas the process kept (docs/scale.md).
    schedule = ReconcileSchedule()
    wakeup = asyncio.Event()

    def hand_over(key: str) -> bool:
        """Make `key` due now in the periodic loop; False when there is none (peering)."""
        if not config.standalone:
            return False
        schedule.wake(key, time.monotonic())
        wakeup.set()
        return True

    @kopf.on.startup(registry=registry)
    def configure(settings: kopf.OperatorSettings, **_: Any) -> None:
        # Our own prefixes, so other kopf operators in the cluster never collide with us, and
        # no legacy duplicate keys (kopf docs/continuity.rst).
        settings.persistence.finalizer = f"{GROUP}/finalizer"
        settings.persistence.progress_storage = kopf.AnnotationsProgressStorage(
            prefix=GROUP, v1=False
        )
        settings.persistence.diffbase_storage = kopf.AnnotationsDiffBaseStorage(
            prefix=GROUP, key="last-handled-configuration", v1=False
        )
        settings.posting.reporting_component = FIELD_MANAGER
        settings.posting.reporting_instance = os.environ.get("POD_NAME", "local")
        settings.posting.level = logging.INFO
        settings.networking.request_timeout = config.request_timeout_s
        settings.networking.connect_timeout = 10
        settings.execution.max_workers = 4
        settings.peering.standalone = config.standalone
        if config.peering_name:
            settings.peering.name = config.peering_name

    @kopf.on.startup(registry=registry)
    async def start_background(**_: Any) -> None:
        if config.metrics_port:
            metrics.serve(config.metrics_port)
        background.append(
            asyncio.create_task(observer.run(config.reconcile_interval_s, stop_observing))
        )

    @kopf.on.cleanup(registry=registry)
    async def close_clients(**_: Any) -> None:
        stop_observing.set()
        # Decisions queued behind the running one have neither decided nor written anything:
        # dropped, so the reconciles in flight end within the wait below (the running one
        # finishes and records its decision).
        controller.close()
        for task in background + periodic:
            with contextlib.suppress(asyncio.CancelledError, TimeoutError):
                await asyncio.wait_for(task, timeout=5)
        await kube.close()

    @kopf.on.login(registry=registry)
    def login(**_: Any) -> kopf.ConnectionInfo:
        """kopf talks to the same API server, with the same credentials, as our client."""
        return connection_info(config.credentials)

    # Indexes keep what every reconcile needs in memory, so an idle cycle makes no API call.
    # They are coroutines because kopf runs plain functions in its thread pool: a thread hop
    # per watch event costs more CPU than the copy itself, and threads fragment the heap.
    @kopf.index(GROUP, VERSION, POLICIES, id="policy_index", registry=registry)
    async def policy_index(name: str, spec: kopf.Spec, **_: Any) -> dict[str, dict[str, Any]]:
        return {name: dict(spec)}

    @kopf.index("", "v1", "namespaces", id="namespace_index", registry=registry)
    async def namespace_index(
        name: str, labels: kopf.Labels, **_: Any
    ) -> dict[str, dict[str, str]]:
        return {name: dict(labels)}

    @kopf.index(GROUP, VERSION, DEPLOYMENTS, id="vllm_index", registry=registry)
    async def vllm_index(
        namespace: str | None, name: str | None, body: kopf.Body, **_: Any
    ) -> dict[str, PackedChild]:
        return {_child_key(namespace, name): packed_copy(body)}

    managed = {MANAGED_BY_LABEL: MANAGED_BY_VALUE}

    @kopf.index(
        "apps", "v1", "deployments", labels=managed, id="deployment_index", registry=registry
    )
    async def deployment_index(
        namespace: str | None, name: str | None, body: kopf.Body, **_: Any
    ) -> dict[str, PackedChild]:
        return {_child_key(namespace, name): packed_copy(body)}

    @kopf.index("", "v1", "services", labels=managed, id="service_index", registry=registry)
    async def service_index(
        namespace: str | None, name: str | None, body: kopf.Body, **_: Any
    ) -> dict[str, PackedChild]:
        return {_child_key(namespace, name): packed_copy(body)}

    # A pod counts only when a ReplicaSet of our Deployment owns it (labels alone prove
    # nothing: anyone can copy them), so the ReplicaSets are indexed too, by their owner label.
    @kopf.index(
        "apps", "v1", "replicasets", labels=managed, id="replicaset_index", registry=registry
    )
    async def replicaset_index(
        namespace: str | None, labels: kopf.Labels, body: kopf.Body, **_: Any
    ) -> dict[str, PackedChild] | None:
        owner = labels.get(DEPLOYMENT_LABEL)
        return {_child_key(namespace, owner): packed_copy(body, keep_spec=False)} if owner else None

    @kopf.index("", "v1", "pods", labels=managed, id="pod_index", registry=registry)
    async def pod_index(
        namespace: str | None, labels: kopf.Labels, body: kopf.Body, **_: Any
    ) -> dict[str, PackedChild] | None:
        owner = labels.get(DEPLOYMENT_LABEL)
        return {_child_key(namespace, owner): packed_copy(body, keep_spec=False)} if owner else None

    @kopf.on.event(GROUP, VERSION, POLICIES, id="policy_status", registry=registry)
    async def publish_policy_status(body: kopf.Body, type: str | None, **kwargs: Any) -> None:
        """A policy says whether it is usable, so Argo CD and kubectl show bad ones at once."""
        start_periodic(kwargs)
        if type == "DELETED":
            return
        patch = policy_status_patch(dict(body), controller.clock())
        if patch:
            path = resource_path(API_VERSION, POLICIES, None, body["metadata"]["name"])
            await kube.merge_patch(path, {"status": patch}, subresource="status")

    async def run_reconcile(
        body: Mapping[str, Any],
        indexes: Mapping[str, Any],
        known_children: Mapping[str, Mapping[str, Any] | None] | None = None,
    ) -> Outcome:
        meta = body["metadata"]
        key = _child_key(meta.get("namespace"), meta.get("name"))
        ns_labels = _first(indexes["namespace_index"], meta.get("namespace")) or {}
        # Every policy: which ones select the namespace decides which it may name.
        index = indexes["policy_index"]
        policies = {name: policy for name in index if (policy := _first(index, name)) is not None}
        await in_flight.acquire()
        started = time.perf_counter()
        try:
            outcome = await controller.reconcile(
                body,
                policies=policies,
                namespace_labels=ns_labels,
                children={
                    "Deployment": _first(indexes["deployment_index"], key),
                    "Service": _first(indexes["service_index"], key),
                    "Canary": _first(indexes["deployment_index"], key + CANARY_SUFFIX),
                    **(known_children or {}),
                },
                pods=_all(indexes["pod_index"], key),
                replicasets=_all(indexes["replicaset_index"], key),
            )
        except RETRIABLE as exc:
            metrics.reconcile_errors.labels(meta.get("namespace"), meta.get("name")).inc()
            failures[key] = failures.get(key, 0) + 1
            delay = retry_delay(failures[key], config.reconcile_interval_s)
            # The periodic reconcile (loop or timer) retries after `delay` with the freshest
            # body kopf has seen; event handlers are not retried by kopf, it catches up for them.
            raise kopf.TemporaryError(
                f"reconcile failed ({type(exc).__name__}: {exc}); retry in {delay:.2f}s",
                delay=delay,
            ) from exc
        except Exception:
            # kopf retries the handler; the counter is what alerts see (docs/operations.md).
            metrics.reconcile_errors.labels(meta.get("namespace"), meta.get("name")).inc()
            raise
        else:
            failures.pop(key, None)
        finally:
            in_flight.release()
            metrics.reconcile_duration.observe(time.perf_counter() - started)
        for event in outcome.events:
            poster = kopf.warn if event.type == "Warning" else kopf.info
            poster(cast(Any, dict(body)), reason=event.reason, message=event.message)
        return outcome

    async def reconcile_key(key: str, indexes: Mapping[str, Any]) -> float:
        """One periodic reconcile from the index's copy; the seconds until the next one."""
        body = _first(indexes["vllm_index"], key)
        if body is None or body.get("metadata", {}).get("deletionTimestamp"):
            return config.reconcile_interval_s
        try:
            await run_reconcile(dict(body), indexes)
        except kopf.TemporaryError as exc:
            log.warning("%s: %s", key, exc)
            return float(exc.delay or config.reconcile_interval_s)
        except Exception:
            log.exception(
                "%s: reconcile failed; retrying in %.0f s", key, config.reconcile_interval_s
            )
        finally:
            if _first(indexes["vllm_index"], key) is None:
                # Deleted while this reconcile ran: the deletion event's forget() came first.
                meta = body["metadata"]
                controller.forget(meta["namespace"], meta["name"])
        return config.reconcile_interval_s

    def start_periodic(indexes: Mapping[str, Any]) -> None:
        """Standalone mode: one loop for every VLLMDeployment (periodic.py says why).

        Started by the first event handler kopf calls, because kopf calls none before every
        index holds its initial listing (no reconcile against half-filled indexes), and from
        inside a handler, because the task inherits kopf's context and kopf.info/warn find
        kopf's Event queue there.
        """
        if periodic or not config.standalone or stop_observing.is_set():
            return
        periodic.append(
            asyncio.create_task(
                run_periodic(
                    keys=lambda: indexes["vllm_index"].keys(),
                    reconcile=lambda key: reconcile_key(key, indexes),
                    stop=stop_observing,
                    failure_delay_s=config.reconcile_interval_s,
                    schedule=schedule,
                    wakeup=wakeup,
                ),
                name="periodic reconcile",
            )
        )

    if not config.standalone:
        # Peering (a warm standby): kopf pauses its timers when a peer takes over; the loop
        # above could not tell, so here each VLLMDeployment keeps its kopf timer.
        @kopf.timer(
            GROUP, VERSION, DEPLOYMENTS, interval=config.reconcile_interval_s, registry=registry
        )
        async def reconcile_periodically(body: kopf.Body, **kwargs: Any) -> None:
            await run_reconcile(dict(body), kwargs)

    @kopf.on.event(GROUP, VERSION, DEPLOYMENTS, id="spec_changed", registry=registry)
    async def reconcile_on_change(body: kopf.Body, type: str | None, **kwargs: Any) -> None:
        """React at once to a new generation instead of waiting for the periodic reconcile."""
        start_periodic(kwargs)
        if type == "DELETED" or body.get("metadata", {}).get("deletionTimestamp"):
            controller.forget(body["metadata"]["namespace"], body["metadata"]["name"])
            failures.pop(_child_key(body["metadata"]["namespace"], body["metadata"]["name"]), None)
            return
        generation = body.get("metadata", {}).get("generation")
        observed = (body.get("status") or {}).get("observedGeneration")
        if generation is not None and generation == observed:
            return
        if hand_over(_child_key(body["metadata"]["namespace"], body["metadata"]["name"])):
            return  # the vllm_index already holds this body (kopf indexes before handlers)
        await run_reconcile(dict(body), kwargs)

    @kopf.on.event(
        "apps", "v1", "deployments", labels=managed, id="child_changed", registry=registry
    )
    async def reconcile_owner(body: kopf.Body, type: str | None, **kwargs: Any) -> None:
        """A child changed (became available, was edited or deleted): reconcile its owner."""
        start_periodic(kwargs)
        owners = [
            ref
            for ref in body.get("metadata", {}).get("ownerReferences") or []
            if ref.get("apiVersion") == API_VERSION and ref.get("kind") == "VLLMDeployment"
        ]
        if not owners:
            return
        namespace = body["metadata"]["namespace"]
        is_canary = (body.get("metadata", {}).get("labels") or {}).get(TRACK_LABEL) == "canary"
        kind = "Canary" if is_canary else "Deployment"
        if type == "DELETED":
            controller.child_deleted(namespace, owners[0]["name"], kind)
        # kopf updated the deployment_index with this event before calling us, so the loop's
        # reconcile reads the child as fresh as this event (a deleted one is gone from it).
        if hand_over(_child_key(namespace, owners[0]["name"])):
            return
        owner = await kube.get(
            resource_path(API_VERSION, DEPLOYMENTS, namespace, owners[0]["name"])
        )
        if owner is None or owner.get("metadata", {}).get("deletionTimestamp"):
            return
        # The event is fresher than the index: use it (a deleted child gets re-created).
        child = None if type == "DELETED" else dict(body)
        await run_reconcile(owner, kwargs, {kind: child})

    return registry, controller


async def run_operator(
    config: OperatorConfig,
    *,
    namespaces: list[str] | None = None,
    liveness_endpoint: str | None = None,
    stop_flag: asyncio.Event | None = None,
    snapshot_source: SnapshotSource | None = None,
) -> None:
    if snapshot_source is None and not config.prometheus_url:
        log.warning(
            "no --prometheus-url: VLLMDeployments are deployed with the knobs they start from, "
            "but nothing is observed, tuned or verified (MetricsAvailable=False on each)"
        )
    allow_api_server_depth()
    tolerate_undecodable_watch_events()
    registry, _ = build_registry(config, snapshot_source)
    await kopf.operator(
        registry=registry,
        clusterwide=not namespaces,
        namespaces=namespaces or [],
        standalone=config.standalone,
        peering_name=config.peering_name,
        priority=config.priority,
        liveness_endpoint=liveness_endpoint,
        stop_flag=stop_flag,
    )
