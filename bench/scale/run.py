"""One scale run: N VLLMDeployments in M namespaces, the real operator process, measured.

The operator runs as `vllm-autotuner run` in its own process (so its memory is its own, read
from /proc/PID/status), against the real kube-apiserver and the Prometheus stub. Reconcile
durations come from the operator's own histogram on its metrics port; API writes from the
API server's audit log; queries per cycle from the stub's log.
"""

from __future__ import annotations

import json
import math
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections import Counter
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import requests

from bench.scale.apiserver import api_server
from bench.scale.kubelet import USER_AGENT as KUBELET_AGENT
from bench.scale.kubelet import FleetKubelet
from bench.scale.promstub import StubPrometheus, cycles

REPO = Path(__file__).resolve().parents[2]
DRIVER_AGENT = "bench-driver"
GROUP_PATH = "/apis/vllm.autotuner.io/v1alpha1"

POLICY: dict[str, Any] = {
    "apiVersion": "vllm.autotuner.io/v1alpha1",
    "kind": "VLLMTuningPolicy",
    "metadata": {"name": "default"},
    "spec": {
        "slo": {
            "ttft": {"percentile": 95, "thresholdMs": 800},
            "itl": {"percentile": 95, "thresholdMs": 50},
        },
        "minRequestsPerWindow": 50,
    },
}


def deployment(index: int, namespaces: int) -> dict[str, Any]:
    return {
        "apiVersion": "vllm.autotuner.io/v1alpha1",
        "kind": "VLLMDeployment",
        "metadata": {"name": f"llm-{index:04d}", "namespace": f"team-{index % namespaces:02d}"},
        "spec": {
            "model": "meta-llama/Llama-3.1-8B-Instruct",
            "gpu": {"product": "H100"},
            "tuning": {"mode": "Recommend"},
        },
    }


@dataclass
class RunResult:
    deployments: int
    namespaces: int
    interval_s: float
    converge_s: float
    converged: int
    reconciles_total: int
    reconcile_p50_s: float | None
    reconcile_p99_s: float | None
    reconcile_mean_s: float | None
    reconciles_over_1s: int
    idle_reconciles: int
    idle_p50_s: float | None
    idle_p99_s: float | None
    idle_mean_s: float | None
    idle_writes: int
    idle_writes_by_resource: dict[str, int]
    queries_per_cycle: list[int]
    rss_mib: float
    hwm_mib: float
    operator_cpu_s: float
    notes: list[str] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def profile_args(path: Path) -> list[str]:
    """BENCH_SCALE_PROFILE=1 runs the operator under cProfile (written when it stops)."""
    return ["-m", "cProfile", "-o", str(path)] if os.environ.get("BENCH_SCALE_PROFILE") else []


def operator_module() -> str:
    """BENCH_SCALE_TRACEMALLOC=PATH attributes the operator's memory (bench/scale/traced.py)."""
    traced = os.environ.get("BENCH_SCALE_TRACEMALLOC")
    return "bench.scale.traced" if traced else "vllm_autotuner.cli"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


# ------------------------------------------------------------------ the operator's histogram

_BUCKET = re.compile(
    r'^vllm_autotuner_reconcile_duration_seconds_bucket\{le="([^"]+)"\}\s+(\S+)$', re.M
)


_SUM = re.compile(r"^vllm_autotuner_reconcile_duration_seconds_sum\s+(\S+)$", re.M)


def scrape_histogram(port: int) -> tuple[list[tuple[float, float]], float]:
    """Cumulative (le, count) buckets and the sum of durations."""
    text = requests.get(f"http://127.0.0.1:{port}/metrics", timeout=10).text
    m = _SUM.search(text)
    buckets = sorted((float(le), float(v)) for le, v in _BUCKET.findall(text))
    return buckets, float(m.group(1)) if m else 0.0


Buckets = list[tuple[float, float]]


def delta(after: Buckets, before: Buckets) -> Buckets:
    base = dict(before)
    return [(le, v - base.get(le, 0.0)) for le, v in after]


def quantile(q: float, buckets: list[tuple[float, float]]) -> float | None:
    """histogram_quantile as Prometheus computes it (linear within a bucket); an answer in the
    +Inf bucket is reported as the highest finite bound."""
    if not buckets or buckets[-1][1] <= 0:
        return None
    rank = q * buckets[-1][1]
    lower_bound, lower_count = 0.0, 0.0
    for bound, count in buckets:
        if count >= rank:
            if math.isinf(bound):
                return lower_bound
            if count == lower_count:
                return bound
            share = (rank - lower_count) / (count - lower_count)
            return lower_bound + (bound - lower_bound) * share
        lower_bound, lower_count = bound, count
    return lower_bound


def count_over(buckets: list[tuple[float, float]], threshold: float) -> int:
    total = buckets[-1][1] if buckets else 0.0
    at = dict(buckets).get(threshold, total)
    return round(total - at)


# ------------------------------------------------------------------ process memory


def proc_memory(pid: int) -> tuple[float, float]:
    """(VmRSS, VmHWM) in MiB."""
    values = {}
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        key, _, rest = line.partition(":")
        if key in ("VmRSS", "VmHWM"):
            values[key] = int(rest.split()[0]) / 1024
    return values.get("VmRSS", 0.0), values.get("VmHWM", 0.0)


def memory_map(pid: int) -> str:
    """Where the resident memory is: /proc/PID/smaps_rollup, then Rss and Anonymous per
    mapping (anonymous mappings grouped as one, the largest first), for docs/scale.md."""
    rollup = Path(f"/proc/{pid}/smaps_rollup").read_text()
    rss: Counter[str] = Counter()
    anon: Counter[str] = Counter()
    count: Counter[str] = Counter()
    name = ""
    for line in Path(f"/proc/{pid}/smaps").read_text().splitlines():
        first = line.split(maxsplit=1)[0]
        if "-" in first and not first.endswith(":"):
            parts = line.split(maxsplit=5)
            name = parts[5].strip() if len(parts) > 5 else "[anon]"
            count[name] += 1
        elif first == "Rss:":
            rss[name] += int(line.split()[1])
        elif first == "Anonymous:":
            anon[name] += int(line.split()[1])
    rows = [
        f"{rss[k] / 1024:8.1f} MiB rss {anon[k] / 1024:8.1f} MiB anon {count[k]:5d} maps  {k}"
        for k, _ in rss.most_common(40)
    ]
    return rollup + "\n" + "\n".join(rows) + "\n"


def proc_cpu_s(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    ticks = os.sysconf("SC_CLK_TCK")
    return (int(fields[11]) + int(fields[12])) / ticks


# ------------------------------------------------------------------ the run


def _converged(session: requests.Session, url: str) -> int:
    items = session.get(url + GROUP_PATH + "/vllmdeployments", timeout=60).json()["items"]
    done = 0
    for item in items:
        conds = {c["type"]: c["status"] for c in (item.get("status") or {}).get("conditions", [])}
        if conds.get("MetricsAvailable") == "True" and (item.get("status") or {}).get("observed"):
            done += 1
    return done


def run_once(
    n: int,
    namespaces: int,
    *,
    interval_s: float,
    idle_cycles: int,
    out: Path,
    timeout_s: float,
    log: Any = print,
) -> RunResult:
    out.mkdir(parents=True, exist_ok=True)
    namespaces = max(1, min(namespaces, n))
    notes: list[str] = []
    # A previous run's etcd holds its objects: every create would answer 409 Conflict.
    shutil.rmtree(out / f"controlplane-{n}", ignore_errors=True)
    with api_server(REPO / "crds", out / f"controlplane-{n}") as apiserver:
        return _run(n, namespaces, apiserver, interval_s, idle_cycles, out, timeout_s, notes, log)


def _run(
    n: int,
    namespaces: int,
    apiserver: Any,
    interval_s: float,
    idle_cycles: int,
    out: Path,
    timeout_s: float,
    notes: list[str],
    log: Any,
) -> RunResult:
    prom = StubPrometheus().start()
    kubeconfig = apiserver.write_kubeconfig(out / f"kubeconfig-{n}.yaml")
    session = apiserver.session(DRIVER_AGENT)
    metrics_port = free_port()
    operator: subprocess.Popen[bytes] | None = None
    log_file = (out / f"operator-{n}.log").open("wb")
    trace = (out / f"operator-{n}-rss.tsv").open("w", buffering=1)  # seconds, converged, MiB
    try:
        for i in range(namespaces):
            namespace = deployment(i, namespaces)["metadata"]["namespace"]
            body = {"metadata": {"name": namespace}}
            session.post(apiserver.url + "/api/v1/namespaces", json=body, timeout=30)
        session.post(apiserver.url + GROUP_PATH + "/vllmtuningpolicies", json=POLICY, timeout=30)
        for i in range(n):
            obj = deployment(i, namespaces)
            path = f"{GROUP_PATH}/namespaces/{obj['metadata']['namespace']}/vllmdeployments"
            r = session.post(apiserver.url + path, json=obj, timeout=30)
            r.raise_for_status()
        started = time.monotonic()
        operator = subprocess.Popen(
            [
                sys.executable,
                *profile_args(out / f"operator-{n}.prof"),
                "-m",
                operator_module(),
                "run",
                "--kubeconfig",
                str(kubeconfig),
                "--prometheus-url",
                prom.url,
                "--reconcile-interval",
                f"{interval_s:g}s",
                "--metrics-port",
                str(metrics_port),
                "--liveness-port",
                "0",
            ],
            stdout=log_file,
            stderr=subprocess.STDOUT,
            cwd=REPO,
        )
        converged = 0
        with FleetKubelet(
            apiserver.url,
            prom.pod_namespace.__setitem__,
            interval_s=5.0,
            session=apiserver.session(KUBELET_AGENT),
        ):
            deadline = started + timeout_s
            while time.monotonic() < deadline:
                if operator.poll() is not None:
                    raise RuntimeError(f"the operator exited with {operator.returncode}")
                converged = _converged(session, apiserver.url)
                trace.write(
                    f"{time.monotonic() - started:.0f}\t{converged}\t{proc_memory(operator.pid)}\n"
                )
                if converged >= n:
                    break
                time.sleep(3 if n <= 100 else 10)
            converge_s = time.monotonic() - started
            log(f"  {n}: {converged}/{n} converged in {converge_s:.0f}s")
            if converged < n:
                notes.append(f"only {converged}/{n} converged within {timeout_s:.0f}s")
            # Let the convergence writes drain (last status patches, events) for one interval.
            time.sleep(interval_s)
            before, before_sum = scrape_histogram(metrics_port)
            apiserver.clear_requests()
            prom.clear()
            time.sleep(idle_cycles * interval_s + 1)
            after, after_sum = scrape_histogram(metrics_port)
            records = apiserver.writes()
            hits = prom.query_hits()
        writes = [
            r for r in records if r.user_agent.split("/")[0] not in (KUBELET_AGENT, DRIVER_AGENT)
        ]
        by_resource = Counter(f"{r.verb} {r.resource}" for r in writes)
        groups = cycles(hits)
        per_cycle = [len(g) for g in groups]
        idle = delta(after, before)
        rss, hwm = proc_memory(operator.pid)
        cpu = proc_cpu_s(operator.pid)
        (out / f"operator-{n}-memory.txt").write_text(memory_map(operator.pid))
        return RunResult(
            deployments=n,
            namespaces=namespaces,
            interval_s=interval_s,
            converge_s=round(converge_s, 1),
            converged=converged,
            reconciles_total=round(after[-1][1]) if after else 0,
            reconcile_p50_s=quantile(0.5, after),
            reconcile_p99_s=quantile(0.99, after),
            reconcile_mean_s=after_sum / after[-1][1] if after and after[-1][1] else None,
            reconciles_over_1s=count_over(after, 1.0),
            idle_reconciles=round(idle[-1][1]) if idle else 0,
            idle_p50_s=quantile(0.5, idle),
            idle_p99_s=quantile(0.99, idle),
            idle_mean_s=(after_sum - before_sum) / idle[-1][1] if idle and idle[-1][1] else None,
            idle_writes=len(writes),
            idle_writes_by_resource=dict(by_resource),
            queries_per_cycle=per_cycle,
            rss_mib=round(rss, 1),
            hwm_mib=round(hwm, 1),
            operator_cpu_s=round(cpu, 1),
            notes=notes,
        )
    finally:
        if operator is not None and operator.poll() is None:
            operator.send_signal(signal.SIGTERM)
            try:
                operator.wait(30)
            except subprocess.TimeoutExpired:
                operator.kill()
                operator.wait(10)
        log_file.close()
        trace.close()
        prom.stop()


def save(results: list[RunResult], out: Path) -> None:
    (out / "scale.json").write_text(json.dumps([r.to_dict() for r in results], indent=2) + "\n")
