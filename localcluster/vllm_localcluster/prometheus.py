"""Run the real Prometheus server on this machine, for tests, the demo and e2e.

Targets come from file-based service discovery, so the set of scraped pods can change while the
server runs (pods of a rollout come and go) without a restart: `set_targets` rewrites the targets
file atomically and Prometheus picks it up. Two delays are inherent to Prometheus 2.x and budget
about 7 s before the first `rate()` has data (client_python #1177): the discovery manager
publishes new targets at most every 5 s, and `rate()` needs two scrapes.

Only the standard library is used: this is plain process and HTTP plumbing.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import tempfile
import time
import urllib.error
import urllib.parse
import urllib.request
from pathlib import Path
from types import TracebackType
from typing import Any

DEFAULT_BINARY = "/usr/bin/prometheus"
TARGETS_FILE = "targets.json"


class PrometheusError(RuntimeError):
    """Prometheus is missing, did not start, or answered a query with an error."""


def find_prometheus_binary(binary: str | None = None) -> str:
    """Locate the server: an explicit path, $PROMETHEUS_BIN, /usr/bin/prometheus, then PATH."""
    candidates = [
        binary,
        os.environ.get("PROMETHEUS_BIN"),
        DEFAULT_BINARY,
        shutil.which("prometheus"),
    ]
    for candidate in candidates:
        if candidate and os.path.isfile(candidate) and os.access(candidate, os.X_OK):
            return candidate
    raise PrometheusError(
        "the Prometheus server binary was not found (looked at $PROMETHEUS_BIN, "
        f"{DEFAULT_BINARY} and PATH); install it with "
        "`apt-get install --no-install-recommends prometheus` or run scripts/ensure-prometheus.sh"
    )


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago (the caller retries on a clash)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


def render_config(
    targets_file: Path,
    scrape_interval: str,
    evaluation_interval: str,
    rule_files: list[str],
    job_name: str = "vllm",
) -> str:
    """prometheus.yml as JSON (a subset of YAML), so no YAML library is needed."""
    config: dict[str, Any] = {
        "global": {
            "scrape_interval": scrape_interval,
            "scrape_timeout": scrape_interval,
            "evaluation_interval": evaluation_interval,
        },
        "scrape_configs": [
            {
                "job_name": job_name,
                "metrics_path": "/metrics",
                "file_sd_configs": [{"files": [str(targets_file)], "refresh_interval": "1s"}],
            }
        ],
    }
    if rule_files:
        config["rule_files"] = rule_files
    return json.dumps(config, indent=2) + "\n"


class PrometheusServer:
    """One Prometheus process on 127.0.0.1 with its storage and config in `workdir`.

    Use as a context manager, or call `start()` and `stop()`. Target groups have the file SD
    shape: `[{"targets": ["127.0.0.1:8000"], "labels": {"namespace": "ns", "pod": "p"}}]`;
    a `job` label in a group overrides the scrape job's name.
    """

    def __init__(
        self,
        workdir: str | os.PathLike[str] | None = None,
        scrape_interval: str = "1s",
        port: int | None = None,
        *,
        evaluation_interval: str | None = None,
        retention: str = "2h",
        rule_files: list[str] | None = None,
        binary: str | None = None,
        ready_timeout: float = 30.0,
    ) -> None:
        self._own_workdir = workdir is None
        # Absolute: the config names the targets file, and Prometheus resolves relative paths
        # against its own config directory, not our working directory.
        self.workdir = Path(
            workdir if workdir is not None else tempfile.mkdtemp(prefix="prom-")
        ).resolve()
        self.scrape_interval = scrape_interval
        self.evaluation_interval = evaluation_interval or scrape_interval
        self.retention = retention
        self.rule_files = list(rule_files or [])
        self.binary = find_prometheus_binary(binary)
        self.ready_timeout = ready_timeout
        self._requested_port = port
        self.port: int = port or 0
        self.process: subprocess.Popen[bytes] | None = None
        self.targets_file = self.workdir / TARGETS_FILE
        self.config_file = self.workdir / "prometheus.yml"
        self.log_file = self.workdir / "prometheus.log"

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def set_targets(self, groups: list[dict[str, Any]]) -> None:
        """Replace the scraped targets; written to a temporary file and renamed, so Prometheus
        never reads a half-written file."""
        self.workdir.mkdir(parents=True, exist_ok=True)
        tmp = self.targets_file.with_name(f".{TARGETS_FILE}.{os.getpid()}.tmp")
        tmp.write_text(json.dumps(groups, indent=2) + "\n")
        os.replace(tmp, self.targets_file)

    def start(self) -> PrometheusServer:
        self.workdir.mkdir(parents=True, exist_ok=True)
        if not self.targets_file.exists():
            self.set_targets([])
        self.config_file.write_text(
            render_config(
                self.targets_file,
                self.scrape_interval,
                self.evaluation_interval,
                self.rule_files,
            )
        )
        # A free port can be taken between probing and binding; retry with another one.
        attempts = 1 if self._requested_port else 3
        last_error: PrometheusError | None = None
        for _ in range(attempts):
            self.port = self._requested_port or free_port()
            try:
                self._spawn_and_wait()
                return self
            except PrometheusError as exc:
                last_error = exc
                self._terminate()
        assert last_error is not None
        raise last_error

    def _spawn_and_wait(self) -> None:
        args = [
            self.binary,
            f"--config.file={self.config_file}",
            f"--storage.tsdb.path={self.workdir / 'data'}",
            f"--storage.tsdb.retention.time={self.retention}",
            f"--web.listen-address=127.0.0.1:{self.port}",
            "--web.enable-lifecycle",
            "--log.level=warn",
        ]
        with self.log_file.open("ab") as log:
            self.process = subprocess.Popen(
                args, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL
            )
        deadline = time.monotonic() + self.ready_timeout
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise PrometheusError(
                    f"prometheus exited with code {self.process.returncode}:\n{self._log_tail()}"
                )
            if self.is_ready():
                return
            time.sleep(0.1)
        raise PrometheusError(
            f"prometheus not ready after {self.ready_timeout:.0f}s on {self.url}:\n"
            f"{self._log_tail()}"
        )

    def _log_tail(self, lines: int = 20) -> str:
        try:
            return "\n".join(self.log_file.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return "(no log)"

    def is_ready(self) -> bool:
        try:
            with urllib.request.urlopen(f"{self.url}/-/ready", timeout=1.0) as response:
                return bool(response.status == 200)
        except (urllib.error.URLError, OSError):
            return False

    def _terminate(self) -> None:
        process, self.process = self.process, None
        if process is None or process.poll() is not None:
            return
        process.terminate()
        try:
            process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait(timeout=10)

    def stop(self) -> None:
        """Stop the server; a workdir this object created itself is removed too."""
        self._terminate()
        if self._own_workdir:
            shutil.rmtree(self.workdir, ignore_errors=True)

    def __enter__(self) -> PrometheusServer:
        return self.start()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()

    # --- small HTTP API helpers, enough for tests and the demo ---

    def _get(self, path: str, params: dict[str, str] | None = None) -> Any:
        query = f"?{urllib.parse.urlencode(params)}" if params else ""
        try:
            with urllib.request.urlopen(f"{self.url}{path}{query}", timeout=10.0) as response:
                body = json.loads(response.read())
        except urllib.error.HTTPError as exc:
            body = json.loads(exc.read() or b"{}")
        except (urllib.error.URLError, OSError) as exc:
            raise PrometheusError(f"{self.url}{path}: {exc}") from exc
        if body.get("status") != "success":
            raise PrometheusError(f"{path} failed: {body.get('errorType')}: {body.get('error')}")
        return body["data"]

    def query(self, expr: str, time_s: float | None = None) -> list[dict[str, Any]]:
        """An instant query; the result list of the vector (values are strings, as in the API)."""
        params = {"query": expr}
        if time_s is not None:
            params["time"] = f"{time_s:.3f}"
        data = self._get("/api/v1/query", params)
        result = data["result"]
        if data.get("resultType") == "scalar":
            return [{"metric": {}, "value": result}]
        return list(result)

    def active_targets(self) -> list[dict[str, Any]]:
        return list(self._get("/api/v1/targets", {"state": "active"})["activeTargets"])

    def reload(self) -> None:
        """Re-read prometheus.yml and rule files (needs --web.enable-lifecycle, which we set)."""
        request = urllib.request.Request(f"{self.url}/-/reload", method="POST")
        with urllib.request.urlopen(request, timeout=10.0):
            pass
