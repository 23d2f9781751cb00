"""The operator image carries what `vllm-autotuner run` imports, and nothing the demo or the
`recommend` CLI alone need.

A real `vllm-autotuner run` reconciles a VLLMDeployment against the real API server while reading
the real Prometheus (so the Kubernetes client, the Prometheus adapter, the tuner and the metrics
server all run), in a process where every installed package that `pip install vllm-autotuner`
(no extras) would not install is hidden, as in the image: importing one fails as if it were
absent, so an optional import (kubernetes' of kubernetes-validate) takes its fallback and a
missing dependency crashes the run. At exit it writes the modules it imported.
"""

from __future__ import annotations

import importlib.metadata as md
import json
import re
import signal
import subprocess
import sys
import tomllib
from pathlib import Path

from packaging.requirements import Requirement

from tests.support.cluster_api import CR, CR_PATH, NS, POLICY, POLICY_PATH, Api, ApiServer
from tests.support.cluster_api import api as api
from tests.support.waiting import wait_for
from vllm_localcluster.prometheus import PrometheusServer

ROOT = Path(__file__).resolve().parents[2]
ONLY_FOR_DEMO_OR_RECOMMEND = {"matplotlib", "kmock", "prometheus-api-client", "dateparser"}

RUN = """
import atexit, importlib.abc, json, sys
HIDDEN = set(json.loads(sys.argv[3]))
class Hide(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if any(name == h or name.startswith(h + ".") for h in HIDDEN):
            raise ModuleNotFoundError(f"No module named {name!r} (not in the image)", name=name)
        return None
sys.meta_path.insert(0, Hide())
def dump():
    with open(sys.argv[1], "w") as out:
        json.dump(sorted(m for m, v in sys.modules.items() if v is not None), out)
atexit.register(dump)
from vllm_autotuner.cli import main
sys.exit(main(sys.argv[4:]))
"""


def _name(requirement: str) -> str:
    return re.sub(r"[-_.]+", "-", Requirement(requirement).name).lower()


def runtime_closure() -> set[str]:
    """The distributions `pip install vllm-autotuner` installs (no extras), by normalized name."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    todo = [_name(r) for r in project["dependencies"]]
    seen: set[str] = set()
    while todo:
        name = todo.pop()
        if name in seen:
            continue
        seen.add(name)
        for text in md.requires(name) or []:
            req = Requirement(text)
            if req.marker is None or req.marker.evaluate({"extra": ""}):
                todo.append(_name(text))
    return seen


def hidden_modules(closure: set[str]) -> list[str]:
    """Modules the image would not have: those of distributions it does not install, and
    kubernetes.aio, which the Dockerfile deletes."""
    hidden = ["kubernetes.aio"]
    for top, dists in md.packages_distributions().items():
        names = {re.sub(r"[-_.]+", "-", d).lower() for d in dists}
        if top in sys.stdlib_module_names or top in ("vllm_autotuner", "vllm_sim"):
            continue
        if not names & closure and not top.startswith("_"):
            hidden.append(top)
    return sorted(hidden)


def distributions_of(modules: list[str]) -> set[str]:
    owners = md.packages_distributions()
    found = set()
    for module in modules:
        top = module.split(".")[0]
        if top in sys.stdlib_module_names or top in ("vllm_autotuner", "vllm_sim", "__main__"):
            continue
        if top == "_distutils_hack":  # setuptools' .pth hook in this venv, not the operator's
            continue
        for dist in owners.get(top, []):
            found.add(re.sub(r"[-_.]+", "-", dist).lower())
    return found


def test_the_runtime_dependencies_leave_out_the_demo_and_recommend() -> None:
    assert runtime_closure() & ONLY_FOR_DEMO_OR_RECOMMEND == set()


def test_run_imports_only_what_the_image_installs(
    apiserver: ApiServer,
    api: Api,
    prometheus: PrometheusServer,
    tmp_path: Path,
) -> None:
    api.create(POLICY_PATH, POLICY)
    api.create(CR_PATH, CR)
    kubeconfig = apiserver.write_kubeconfig(tmp_path / "kubeconfig", NS)
    modules_file = tmp_path / "modules.json"
    command = [
        sys.executable, "-c", RUN, str(modules_file), "-",
        json.dumps(hidden_modules(runtime_closure())),
        "run", "--kubeconfig", str(kubeconfig), "-n", NS, "--prometheus-url", prometheus.url,
        "--reconcile-interval", "1s", "--liveness-port", "0", "--metrics-port", "0",
    ]  # fmt: skip
    proc = subprocess.Popen(command, stderr=subprocess.PIPE, text=True)
    try:
        path = f"{CR_PATH}/{CR['metadata']['name']}"

        def decided() -> object:
            assert proc.poll() is None, f"the operator exited with {proc.returncode}"
            return ((api.get(path) or {}).get("status") or {}).get("tuning")

        wait_for(decided, timeout=60, message="a tuning decision in status")
    finally:
        proc.send_signal(signal.SIGTERM)
        _, stderr = proc.communicate(timeout=60)
    assert proc.returncode == 0, stderr[-2000:]
    modules = json.loads(modules_file.read_text())
    assert not [m for m in modules if m.startswith("kubernetes.aio")]
    imported = distributions_of(modules)
    assert {"kopf", "kubernetes", "pydantic", "aiohttp", "prometheus-client"} <= imported
    assert imported - runtime_closure() == set()
    assert imported & ONLY_FOR_DEMO_OR_RECOMMEND == set()
