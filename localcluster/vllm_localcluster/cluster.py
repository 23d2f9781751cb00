"""A whole cluster on one machine: a real control plane, the node agent and the real Prometheus.

The demo and the closed-loop e2e suite need the same parts wired the same way: etcd,
kube-apiserver, kube-controller-manager and kube-scheduler of the pinned release
(controlplane/), with the CRDs installed; the node agent running the pods bound to its nodes
as vllm-sim processes; the pods feeding Prometheus' file service discovery with the labels
Kubernetes service discovery gives (namespace, pod, container, job); and everything (simulator
processes included) gone when the cluster stops, whether the caller returned, raised or was
interrupted with Ctrl-C.

    with LocalCluster(workdir="run", time_scale=10) as cluster:
        cluster.kubeconfig      # point the operator, kubectl or any client at it
        cluster.prometheus_url  # point the operator's Prometheus adapter at it

Standalone, until Ctrl-C or SIGTERM: `vllm-localcluster cluster --workdir run`.
"""

from __future__ import annotations

import argparse
import atexit
import contextlib
import shutil
import signal
import tempfile
import threading
from collections.abc import Mapping, Sequence
from pathlib import Path
from types import FrameType, TracebackType
from typing import Any, Self

from vllm_autotuner.adapters.kube import KubeClient, KubeCredentials
from vllm_localcluster.controlplane import ControlPlane, pki
from vllm_localcluster.kubeapi import Endpoint
from vllm_localcluster.node import SIM_COMMAND, KubeletConfig, NodeAgent
from vllm_localcluster.prometheus import PrometheusServer
from vllm_localcluster.service_proxy import routable


class LocalCluster:
    """Start with `start()` or `with`; `stop()` is idempotent and also runs at interpreter exit.

    `time_scale` is the simulator's virtual seconds per wall second (VLLM_SIM_TIME_SCALE of every
    pod); `speed` divides the kubelet's crash back-off, so a demo at 10x does not wait minutes
    for a CrashLoopBackOff. `sim_env` adds VLLM_SIM_* settings (e.g. the GPU or the OOM hazard)
    to every pod; a pod's own env wins. `sim_env_by_labels` adds settings to the pods whose
    labels include a selector's only (e.g. a slower GPU under the canary pod:
    `((({"vllm.autotuner.io/track": "canary"}, {"VLLM_SIM_BANDWIDTH_EFFICIENCY": "0.3"}),)`).
    `run_any_command` lets pods run commands other than `vllm serve` (tests with plain
    processes); `max_grace_s` caps grace periods.
    """

    def __init__(
        self,
        workdir: str | Path | None = None,
        *,
        time_scale: float = 1.0,
        speed: float = 1.0,
        sim_env: Mapping[str, str] | None = None,
        sim_env_by_labels: Sequence[tuple[Mapping[str, str], Mapping[str, str]]] = (),
        scrape_interval: str = "1s",
        with_prometheus: bool = True,
        launcher: tuple[str, ...] = SIM_COMMAND,
        poll_interval_s: float = 0.3,
        handle_sigterm: bool = False,
        run_any_command: bool = False,
        max_grace_s: float | None = None,
        audit: bool = False,
    ) -> None:
        self._own_workdir = workdir is None
        self.workdir = (
            Path(workdir) if workdir is not None else Path(tempfile.mkdtemp("-cluster"))
        ).resolve()
        self.time_scale = time_scale
        self.speed = speed
        self.sim_env = dict(sim_env or {})
        self.sim_env_by_labels = tuple((dict(sel), dict(env)) for sel, env in sim_env_by_labels)
        self.scrape_interval = scrape_interval
        self.with_prometheus = with_prometheus
        self.launcher = launcher
        self.poll_interval_s = poll_interval_s
        self.handle_sigterm = handle_sigterm
        self.run_any_command = run_any_command
        self.max_grace_s = max_grace_s
        self.audit = audit  # the API server's audit log (ControlPlane.audit_log), for tests
        self.control_plane: ControlPlane | None = None
        self.prometheus: PrometheusServer | None = None
        self.agent: NodeAgent | None = None
        self._previous_sigterm: Any = None
        self._stopped = threading.Event()

    # ------------------------------------------------------------------ what callers use

    @property
    def url(self) -> str:
        """The API server's URL (https; trust `ca_file`, send `token`)."""
        return self._control_plane().url

    @property
    def kubeconfig(self) -> Path:
        """The admin kubeconfig (kubectl, the operator, the `kubernetes` package)."""
        return self._control_plane().kubeconfig

    @property
    def ca_file(self) -> Path:
        return self._control_plane().ca_file

    @property
    def token(self) -> str:
        return self._control_plane().token

    @property
    def prometheus_url(self) -> str:
        if self.prometheus is None:
            raise RuntimeError("this cluster runs without Prometheus")
        return self.prometheus.url

    def _control_plane(self) -> ControlPlane:
        if self.control_plane is None:
            raise RuntimeError("the cluster is not running")
        return self.control_plane

    def credentials(self) -> KubeCredentials:
        return KubeCredentials.for_server(self.url, token=self.token, ca_file=str(self.ca_file))

    def api_endpoint(self) -> Endpoint:
        return Endpoint(self.url, self.token, str(self.ca_file))

    def kube_client(self) -> KubeClient:
        """An async client for the caller's own event loop (close it there)."""
        return KubeClient(self.credentials())

    def request(
        self,
        method: str,
        path: str,
        body: Any = None,
        *,
        content_type: str = "application/json",
        timeout: float = 10.0,
    ) -> tuple[int, Any]:
        """One call as the admin: (status, parsed JSON or text)."""
        return self._control_plane().request(
            method, path, body, content_type=content_type, timeout=timeout
        )

    def endpoints(self, namespace: str, service: str) -> list[tuple[str, str]]:
        """(pod, base URL) of a Service's routable endpoints, from its EndpointSlices: where to
        send load (the operator names the Service after the VLLMDeployment)."""
        path = f"/apis/discovery.k8s.io/v1/namespaces/{namespace}/endpointslices"
        status, body = self.request(
            "GET", f"{path}?labelSelector=kubernetes.io/service-name%3D{service}"
        )
        return routable(body.get("items", [])) if status == 200 else []

    def pids(self) -> set[int]:
        """Every process this cluster started: pods, Prometheus and the control plane."""
        pids = self.agent.pids() if self.agent is not None else set()
        process = self.prometheus.process if self.prometheus is not None else None
        if process is not None:
            pids.add(process.pid)
        if self.control_plane is not None:
            pids |= self.control_plane.pids()
        return pids

    # ------------------------------------------------------------------ lifecycle

    def start(self) -> Self:
        self.workdir.mkdir(parents=True, exist_ok=True)
        self._stopped.clear()
        atexit.register(self.stop)
        if self.handle_sigterm and threading.current_thread() is threading.main_thread():
            self._previous_sigterm = signal.signal(signal.SIGTERM, _raise_interrupt)
        try:
            plane = ControlPlane(self.workdir / "controlplane", audit=self.audit)
            self.control_plane = plane.start()
            on_targets = None
            if self.with_prometheus:
                self.prometheus = PrometheusServer(
                    self.workdir / "prometheus", scrape_interval=self.scrape_interval
                ).start()
                on_targets = self.prometheus.set_targets
            config = KubeletConfig(
                workdir=self.workdir,
                launcher=self.launcher,
                env={"VLLM_SIM_TIME_SCALE": f"{self.time_scale:g}", **self.sim_env},
                env_by_labels=self.sim_env_by_labels,
                backoff_scale=self.speed,
                run_any_command=self.run_any_command,
                max_grace_s=self.max_grace_s,
                on_targets=on_targets,
            )
            cp = self.control_plane
            agent_api = Endpoint(cp.url, cp.token_for(pki.NODE_AGENT[0]), str(cp.ca_file))
            self.agent = NodeAgent(
                agent_api, config, poll_interval_s=self.poll_interval_s
            ).start_in_thread()
        except BaseException:
            self.stop()
            raise
        return self

    def stop(self) -> None:
        """Pods first (their processes), then Prometheus, then the control plane; each step runs
        even if an earlier one failed, so nothing is left behind."""
        if self._stopped.is_set():
            return
        self._stopped.set()
        errors: list[BaseException] = []
        for step in (self._stop_agent, self._stop_prometheus, self._stop_control_plane):
            try:
                step()
            except Exception as exc:
                errors.append(exc)
        if self._previous_sigterm is not None:
            with contextlib.suppress(ValueError):
                signal.signal(signal.SIGTERM, self._previous_sigterm)
            self._previous_sigterm = None
        atexit.unregister(self.stop)
        if self._own_workdir:
            shutil.rmtree(self.workdir, ignore_errors=True)
        if errors:
            raise errors[0]

    def _stop_agent(self) -> None:
        if self.agent is not None:
            self.agent.stop()

    def _stop_prometheus(self) -> None:
        if self.prometheus is not None:
            self.prometheus.stop()

    def _stop_control_plane(self) -> None:
        if self.control_plane is not None:
            self.control_plane.stop()

    def __enter__(self) -> Self:
        return self.start()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()


def _raise_interrupt(signum: int, frame: FrameType | None) -> None:
    """SIGTERM unwinds like Ctrl-C, so `with LocalCluster()` cleans up on `kill` too."""
    raise KeyboardInterrupt(f"signal {signum}")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--workdir", default="local-cluster", help="kubeconfig, logs, TSDB")
    parser.add_argument("--time-scale", type=float, default=1.0, help="VLLM_SIM_TIME_SCALE")
    parser.add_argument("--speed", type=float, default=1.0, help="divides the crash back-off")
    parser.add_argument("--no-prometheus", action="store_true", help="run without Prometheus")


def run(args: argparse.Namespace) -> int:
    cluster = LocalCluster(
        args.workdir,
        time_scale=args.time_scale,
        speed=args.speed,
        with_prometheus=not args.no_prometheus,
        handle_sigterm=True,
    )
    with contextlib.suppress(KeyboardInterrupt), cluster:
        print(f"API server  {cluster.url}")
        print(f"kubeconfig  export KUBECONFIG={cluster.kubeconfig.resolve()}")
        if cluster.prometheus is not None:
            print(f"Prometheus  {cluster.prometheus_url}")
        print(f"pod logs    {(cluster.workdir / 'pods').resolve()}/NAMESPACE/POD.log", flush=True)
        threading.Event().wait()
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m vllm_localcluster.cluster",
        description="A Kubernetes control plane, the node agent and Prometheus, until Ctrl-C.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    add_arguments(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    raise SystemExit(main())
