"""A whole cluster on one machine: API emulator, pod runner and the real Prometheus, together.

The demo and the closed-loop e2e suite need the same three parts wired the same way: the
runner's pods feed Prometheus' file service discovery with the labels Kubernetes service
discovery gives (namespace, pod, container, job), the CRDs are registered before anyone applies
a VLLMDeployment, and everything (simulator processes included) is gone when the cluster stops,
whether the caller returned, raised or was interrupted with Ctrl-C.

    with LocalCluster(workdir="run", time_scale=10) as cluster:
        cluster.kubeconfig      # point the operator (or kubectl --validate=false) at it
        cluster.prometheus_url  # point the operator's Prometheus adapter at it

Standalone, until Ctrl-C or SIGTERM: `python -m vllm_localcluster.cluster --workdir run`.
"""

from __future__ import annotations

import argparse
import atexit
import contextlib
import shutil
import signal
import tempfile
import threading
from collections.abc import Mapping
from pathlib import Path
from types import FrameType, TracebackType
from typing import Any, Self

from vllm_autotuner.adapters.kube import KubeClient, KubeCredentials
from vllm_localcluster.emulator import EmulatorServer
from vllm_localcluster.prometheus import PrometheusServer
from vllm_localcluster.runner import SIM_COMMAND, PodRunner, RunnerConfig


def project_crds() -> list[dict[str, Any]]:
    """The CRDs rendered from the API models (the same content as crds/*.yaml)."""
    from vllm_autotuner.api.crds import render_crds

    return render_crds()


class LocalCluster:
    """Start with `start()` or `with`; `stop()` is idempotent and also runs at interpreter exit.

    `time_scale` is the simulator's virtual seconds per wall second (VLLM_SIM_TIME_SCALE of every
    pod); `speed` divides the kubelet's crash back-off and Deployments' progress deadlines, so a
    demo at 10x does not wait minutes for a CrashLoopBackOff. `sim_env` adds VLLM_SIM_* settings
    (e.g. the GPU or the OOM hazard) to every pod; a pod's own env wins.
    """

    def __init__(
        self,
        workdir: str | Path | None = None,
        *,
        time_scale: float = 1.0,
        speed: float = 1.0,
        sim_env: Mapping[str, str] | None = None,
        scrape_interval: str = "1s",
        with_prometheus: bool = True,
        launcher: tuple[str, ...] = SIM_COMMAND,
        poll_interval_s: float = 0.3,
        handle_sigterm: bool = False,
    ) -> None:
        self._own_workdir = workdir is None
        self.workdir = (
            Path(workdir) if workdir is not None else Path(tempfile.mkdtemp("-cluster"))
        ).resolve()
        self.time_scale = time_scale
        self.speed = speed
        self.sim_env = dict(sim_env or {})
        self.scrape_interval = scrape_interval
        self.with_prometheus = with_prometheus
        self.launcher = launcher
        self.poll_interval_s = poll_interval_s
        self.handle_sigterm = handle_sigterm
        self.emulator: EmulatorServer | None = None
        self.prometheus: PrometheusServer | None = None
        self.runner: PodRunner | None = None
        self._previous_sigterm: Any = None
        self._stopped = threading.Event()

    # ------------------------------------------------------------------ what callers use

    @property
    def url(self) -> str:
        """The API server's URL."""
        if self.emulator is None:
            raise RuntimeError("the cluster is not running")
        return self.emulator.url

    @property
    def kubeconfig(self) -> Path:
        return self.workdir / "kubeconfig"

    @property
    def prometheus_url(self) -> str:
        if self.prometheus is None:
            raise RuntimeError("this cluster runs without Prometheus")
        return self.prometheus.url

    def credentials(self) -> KubeCredentials:
        return KubeCredentials.for_server(self.url)

    def kube_client(self) -> KubeClient:
        """An async client for the caller's own event loop (close it there)."""
        return KubeClient(self.credentials())

    def endpoints(self, namespace: str, deployment: str) -> list[tuple[str, str]]:
        """(pod, base URL) of a Deployment's ready pods: where to send load."""
        return self.runner.endpoints(namespace, deployment) if self.runner is not None else []

    def pids(self) -> set[int]:
        """Every process this cluster started: simulator pods and Prometheus."""
        pids = self.runner.pids() if self.runner is not None else set()
        process = self.prometheus.process if self.prometheus is not None else None
        if process is not None:
            pids.add(process.pid)
        return pids

    # ------------------------------------------------------------------ lifecycle

    def start(self) -> Self:
        self.workdir.mkdir(parents=True, exist_ok=True)
        self._stopped.clear()
        atexit.register(self.stop)
        if self.handle_sigterm and threading.current_thread() is threading.main_thread():
            self._previous_sigterm = signal.signal(signal.SIGTERM, _raise_interrupt)
        try:
            self.emulator = EmulatorServer("127.0.0.1", 0).start_in_thread()
            for crd in project_crds():
                self.emulator.emulator.register_crd(crd)
            self.emulator.write_kubeconfig(self.kubeconfig)
            on_targets = None
            if self.with_prometheus:
                self.prometheus = PrometheusServer(
                    self.workdir / "prometheus", scrape_interval=self.scrape_interval
                ).start()
                on_targets = self.prometheus.set_targets
            config = RunnerConfig(
                workdir=self.workdir,
                launcher=self.launcher,
                env={"VLLM_SIM_TIME_SCALE": f"{self.time_scale:g}", **self.sim_env},
                backoff_scale=self.speed,
                deadline_scale=self.speed,
                poll_interval_s=self.poll_interval_s,
                on_targets=on_targets,
            )
            self.runner = PodRunner.for_url(self.emulator.url, config).start_in_thread()
        except BaseException:
            self.stop()
            raise
        return self

    def stop(self) -> None:
        """Pods first (their processes), then Prometheus, then the API; each step runs even if
        an earlier one failed, so nothing is left behind."""
        if self._stopped.is_set():
            return
        self._stopped.set()
        errors: list[BaseException] = []
        for step in (self._stop_runner, self._stop_prometheus, self._stop_emulator):
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

    def _stop_runner(self) -> None:
        if self.runner is not None:
            self.runner.stop()

    def _stop_prometheus(self) -> None:
        if self.prometheus is not None:
            self.prometheus.stop()

    def _stop_emulator(self) -> None:
        if self.emulator is not None:
            self.emulator.stop()

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


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m vllm_localcluster.cluster",
        description="API emulator + pod runner + Prometheus on this machine, until Ctrl-C.",
    )
    parser.add_argument("--workdir", default="local-cluster", help="kubeconfig, logs, TSDB")
    parser.add_argument("--time-scale", type=float, default=1.0, help="VLLM_SIM_TIME_SCALE")
    parser.add_argument("--speed", type=float, default=1.0, help="divides back-off, deadlines")
    parser.add_argument("--no-prometheus", action="store_true")
    args = parser.parse_args(argv)
    cluster = LocalCluster(
        args.workdir,
        time_scale=args.time_scale,
        speed=args.speed,
        with_prometheus=not args.no_prometheus,
        handle_sigterm=True,
    )
    with contextlib.suppress(KeyboardInterrupt), cluster:
        print(f"API server  {cluster.url}  (KUBECONFIG={cluster.kubeconfig.resolve()})")
        if cluster.prometheus is not None:
            print(f"Prometheus  {cluster.prometheus_url}")
        print(f"pod logs    {(cluster.workdir / 'pods').resolve()}/NAMESPACE/POD.log", flush=True)
        threading.Event().wait()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
