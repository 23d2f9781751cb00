"""What `vllm-autotuner run` writes to its log: a warning without Prometheus, one line per
decision (in JSON with `--log-format json`), and none of kopf's per-handler chatter."""

from __future__ import annotations

import contextlib
import json
import queue
import re
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import requests

from tests.support.cluster_api import CR, CR_PATH, NS, POLICY, POLICY_PATH, Api, ApiServer
from tests.support.cluster_api import api as api


def _lines(stream: Any, out: queue.Queue[str]) -> None:
    for line in iter(stream.readline, ""):
        out.put(line)


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def reconciles(port: int) -> float:
    """How many reconciles the operator has finished, from its own histogram."""
    try:
        text = requests.get(f"http://127.0.0.1:{port}/metrics", timeout=2).text
    except requests.RequestException:
        return 0.0
    match = re.search(r"^vllm_autotuner_reconcile_duration_seconds_count (\S+)$", text, re.M)
    return float(match[1]) if match else 0.0


def run_operator_until(
    kubeconfig: Path, metrics_port: int, done: Any, *, timeout_s: float = 90.0
) -> tuple[list[str], bool]:
    """Run the operator until `done(lines)` holds or the timeout; its stderr lines."""
    command = [
        sys.executable, "-m", "vllm_autotuner.cli", "run",
        "--kubeconfig", str(kubeconfig), "--namespace", NS, "--log-format", "json",
        "--metrics-port", str(metrics_port), "--liveness-port", "0",
        "--reconcile-interval", "1s",
    ]  # fmt: skip
    proc = subprocess.Popen(command, stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True)
    out: queue.Queue[str] = queue.Queue()
    threading.Thread(target=_lines, args=(proc.stderr, out), daemon=True).start()
    lines: list[str] = []
    deadline = time.monotonic() + timeout_s
    met = False
    try:
        while time.monotonic() < deadline and not met:
            with contextlib.suppress(queue.Empty):
                lines.append(out.get(timeout=0.5))
            met = done(lines)
    finally:
        proc.terminate()
        proc.wait(timeout=30)
    return lines, met


def records(lines: list[str]) -> list[dict[str, Any]]:
    out = []
    for line in lines:
        try:
            out.append(json.loads(line))
        except ValueError:
            out.append({"message": line, "not_json": True})
    return out


def test_the_log_has_one_line_per_decision_and_no_kopf_chatter(
    apiserver: ApiServer,
    api: Api,
    tmp_path: Path,
) -> None:
    api.create(POLICY_PATH, POLICY)
    api.create(CR_PATH, CR)
    kubeconfig = apiserver.write_kubeconfig(tmp_path / "kubeconfig", NS)

    port = free_port()

    def reconciled_thrice(lines: list[str]) -> bool:
        return any('"action"' in line for line in lines) and reconciles(port) >= 3

    lines, met = run_operator_until(kubeconfig, port, reconciled_thrice)
    assert met, "".join(lines[-20:])
    logged = records(lines)
    assert not [r for r in logged if r.get("not_json")], "every line is JSON"
    warnings = [r for r in logged if "no --prometheus-url" in str(r.get("message"))]
    assert len(warnings) == 1 and warnings[0]["severity"] == "warn"
    decisions = [r for r in logged if "action" in r]
    assert len(decisions) == 1  # a hold for the same reason is logged once
    (decision,) = decisions
    assert decision["deployment"] == CR["metadata"]["name"] and decision["namespace"] == NS
    assert set(decision["knobs"]) == {"maxNumBatchedTokens", "maxNumSeqs", "gpuMemoryUtilization"}
    assert decision["reason"] and decision["action"] in decision["message"]
    assert not [r for r in logged if "succeeded" in str(r.get("message"))], "kopf's chatter"
