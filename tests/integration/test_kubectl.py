"""kubectl against the local control plane works as against any cluster.

What a user runs beside the demo: `kubectl get vllmd` with the CRD's printer columns (the
server's Table output), `kubectl explain` from the published OpenAPI, `kubectl apply` of the
examples with client and server validation on, `describe`, `get events`, `create ns`, and a
server version the chart accepts (1.29 or later). Skipped where kubectl is not installed.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest

from tests.support.cluster_api import CR, CR_PATH, POLICY, POLICY_PATH, Api, ApiServer

KUBECTL = shutil.which("kubectl")
EXAMPLES = Path(__file__).resolve().parents[2] / "examples"

pytestmark = pytest.mark.skipif(KUBECTL is None, reason="kubectl is not installed")


def kubectl(apiserver: ApiServer, *args: str) -> str:
    assert KUBECTL is not None
    env = {**os.environ, "KUBECONFIG": str(apiserver.kubeconfig)}
    done = subprocess.run(
        [KUBECTL, *args], env=env, capture_output=True, text=True, timeout=60, check=False
    )
    assert done.returncode == 0, done.stderr
    return done.stdout


def test_server_version_is_one_the_chart_accepts(apiserver: ApiServer) -> None:
    out = kubectl(apiserver, "version")
    found = re.search(r"Server Version: v(\d+)\.(\d+)", out)
    assert found is not None, out
    assert (int(found.group(1)), int(found.group(2))) >= (1, 29)


def test_printer_columns_explain_describe_and_events(apiserver: ApiServer, api: Api) -> None:
    api.create(POLICY_PATH, POLICY)
    api.create(CR_PATH, CR)
    table = kubectl(apiserver, "get", "vllmd", "-n", "team-a")
    header = table.splitlines()[0].split()
    assert header[:3] == ["NAME", "MODEL", "MODE"], table
    assert "llama" in table and "Recommend" in table
    assert kubectl(apiserver, "get", "vtp").splitlines()[0].split()[0] == "NAME"
    explained = kubectl(apiserver, "explain", "vllmd.spec")
    assert "model" in explained and "What the app team asks for" in explained
    described = kubectl(apiserver, "describe", "vllmd", "llama", "-n", "team-a")
    assert "meta-llama/Llama-3.1-8B-Instruct" in described
    kubectl(apiserver, "get", "events", "-n", "team-a")


def test_apply_of_the_examples_needs_no_flags(apiserver: ApiServer, api: Api) -> None:
    del api  # cleans up what the examples create
    kubectl(apiserver, "create", "ns", "inference")
    try:
        for example in sorted(EXAMPLES.glob("*.yaml")):
            out = kubectl(apiserver, "apply", "-f", str(example))
            assert "created" in out or "configured" in out or "unchanged" in out, out
        listed = kubectl(apiserver, "get", "vllmd", "-A", "-o", "name")
        assert listed.strip(), "the examples created no VLLMDeployment"
    finally:
        kubectl(apiserver, "delete", "vllmd", "--all", "-n", "inference", "--wait=false")
        kubectl(apiserver, "delete", "ns", "inference", "--wait=false")
