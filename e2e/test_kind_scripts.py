"""Checks of the kind scripts that run here, where Docker and kind do not.

The scripts can only really run on a machine with Docker; what can go wrong before that is
checked here: shell syntax (and shellcheck when installed), every manifest they apply parses
and passes the Kubernetes OpenAPI schemas or our CRDs' schemas and CEL rules, the chart renders
with the scenario's values, and the pieces agree with each other (time scale, Service URL,
Prometheus labels) and with the local scenario 1 they mirror.
"""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml
from tests.support.crd_validation import validate
from tests.support.helm import find, render_objects

from e2e.test_closed_loop import DEMO_RATE
from vllm_autotuner.api.crds import render_crds
from vllm_autotuner.api.deployment import VLLMDeploymentSpec
from vllm_localcluster.demo import DEMO_DEPLOYMENT, DEMO_POLICY

KIND_DIR = Path(__file__).resolve().parent / "kind"
MANIFESTS = KIND_DIR / "manifests"
SCRIPTS = sorted(KIND_DIR.glob("*.sh"))
KUBE_VERSION = "1.33"
NOT_KUBERNETES = {"kind-config.yaml", "operator-values.yaml"}

# Fast (seconds): selected by `make e2e` (-m e2e) and by a plain `pytest e2e` (not slow).
pytestmark = pytest.mark.e2e


def load(name: str) -> list[dict[str, Any]]:
    return [doc for doc in yaml.safe_load_all((MANIFESTS / name).read_text()) if doc]


def one(name: str) -> dict[str, Any]:
    docs = load(name)
    assert len(docs) == 1, name
    return docs[0]


def applied_manifests() -> set[str]:
    """Manifest files the scripts pass to kubectl/helm/kind (`${MANIFESTS}/NAME`)."""
    names: set[str] = set()
    for script in SCRIPTS:
        names |= set(re.findall(r"\$\{MANIFESTS\}/([\w.-]+\.yaml)", script.read_text()))
    return names


def test_there_are_scripts_for_each_step() -> None:
    assert {p.name for p in SCRIPTS} >= {"up.sh", "scenario1.sh", "down.sh", "run.sh", "lib.sh"}


@pytest.mark.parametrize("script", SCRIPTS, ids=lambda p: p.name)
def test_script_syntax(script: Path) -> None:
    result = subprocess.run(["bash", "-n", str(script)], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr


@pytest.mark.skipif(shutil.which("shellcheck") is None, reason="shellcheck is not installed")
def test_shellcheck_is_clean() -> None:
    result = subprocess.run(
        ["shellcheck", "-x", *map(str, SCRIPTS)], capture_output=True, text=True, cwd=KIND_DIR
    )
    assert result.returncode == 0, result.stdout + result.stderr


def test_every_manifest_the_scripts_use_exists_and_every_file_is_used() -> None:
    used = applied_manifests()
    present = {p.name for p in MANIFESTS.glob("*.yaml")}
    assert used, "the scripts apply no manifest"
    assert used == present, (used - present, present - used)


@pytest.mark.parametrize(
    "name",
    sorted(p.name for p in MANIFESTS.glob("*.yaml") if p.name not in NOT_KUBERNETES),
)
def test_kubernetes_objects_pass_the_schemas(name: str) -> None:
    crds = {crd["spec"]["names"]["kind"]: crd for crd in render_crds()}
    docs = load(name)
    assert docs, name
    for obj in docs:
        if obj["kind"] in crds:
            problems = validate(crds[obj["kind"]], obj)
            assert not problems, [str(p) for p in problems]
        else:
            kubernetes_validate.validate(obj, KUBE_VERSION, strict=True)


def test_the_chart_renders_with_the_scenario_values() -> None:
    values = one("operator-values.yaml")
    objects = render_objects(values, namespace="vllm-autotuner-system")
    for obj in objects:
        if obj["kind"] != "CustomResourceDefinition":
            kubernetes_validate.validate(obj, KUBE_VERSION, strict=True)
    (deployment,) = find(objects, "Deployment")
    container = deployment["spec"]["template"]["spec"]["containers"][0]
    assert container["image"] == "vllm-autotuner:e2e"
    assert f"--prometheus-url={values['prometheus']['url']}" in container["args"]


def _prometheus_service_url() -> str:
    service = next(o for o in load("prometheus.yaml") if o["kind"] == "Service")
    meta = service["metadata"]
    return f"http://{meta['name']}.{meta['namespace']}.svc:{service['spec']['ports'][0]['port']}"


def test_the_pieces_agree() -> None:
    values = one("operator-values.yaml")
    cr = one("vllmdeployment.yaml")
    policy = one("policy.yaml")
    job = one("load-job.yaml")
    namespaces = {o["metadata"]["name"] for o in load("namespace.yaml")}

    assert values["prometheus"]["url"] == _prometheus_service_url()
    env = {e["name"]: e["value"] for e in cr["spec"]["pod"]["env"]}
    scale = float(env["VLLM_SIM_TIME_SCALE"])
    assert f"--prometheus-rate-scale={scale:g}" in values["operator"]["extraArgs"]
    args = dict(
        a.removeprefix("--").split("=", 1)
        for a in job["spec"]["template"]["spec"]["containers"][0]["args"]
    )
    assert float(args["time-scale"]) == scale
    # The load goes to the Service the operator renders for the CR (its name, default port).
    port = VLLMDeploymentSpec.model_validate(cr["spec"]).service.port
    ns = cr["metadata"]["namespace"]
    assert args["url"] == f"http://{cr['metadata']['name']}.{ns}.svc:{port}"
    assert job["metadata"]["namespace"] == ns and ns in namespaces
    assert cr["spec"]["tuning"]["policyRef"] == policy["metadata"]["name"]
    # Images: the CR runs the vllm-sim image that up.sh builds and loads into kind.
    up = (KIND_DIR / "lib.sh").read_text()
    assert f'SIM_IMAGE="{cr["spec"]["image"]}"' in up
    assert cr["spec"]["imagePullPolicy"] == "Never"
    # Prometheus discovers the scenario's namespace and keeps the labels the operator selects.
    config = yaml.safe_load(
        next(o for o in load("prometheus.yaml") if o["kind"] == "ConfigMap")["data"][
            "prometheus.yml"
        ]
    )
    (job_config,) = config["scrape_configs"]
    assert job_config["kubernetes_sd_configs"][0]["namespaces"]["names"] == [ns]
    targets = {r.get("target_label") for r in job_config["relabel_configs"]}
    assert {"namespace", "pod", "__address__"} <= targets


def test_the_kind_scenario_is_the_local_scenario_1() -> None:
    """Same SLO, windows and starting point as the demo the local e2e scenario 1 runs."""
    policy = one("policy.yaml")
    assert policy["spec"] == DEMO_POLICY["spec"]
    cr = one("vllmdeployment.yaml")
    for key in ("model", "tuning"):
        if key == "tuning":
            assert cr["spec"][key]["mode"] == DEMO_DEPLOYMENT["spec"][key]["mode"]
        else:
            assert cr["spec"][key] == DEMO_DEPLOYMENT["spec"][key]
    assert cr["spec"]["gpu"]["product"] == DEMO_DEPLOYMENT["spec"]["gpu"]["product"]
    assert "knobs" not in cr["spec"], "scenario 1 starts from vLLM's defaults"
    job = one("load-job.yaml")
    args = dict(
        a.removeprefix("--").split("=", 1)
        for a in job["spec"]["template"]["spec"]["containers"][0]["args"]
    )
    assert args["workload"] == "rag" and float(args["rate"]) == DEMO_RATE


@pytest.mark.skipif(shutil.which("promtool") is None, reason="promtool is not installed")
def test_prometheus_config_is_valid(tmp_path: Path) -> None:
    """promtool checks the rest of the config and every relabel rule (regexes included).

    Debian's Prometheus is built without Kubernetes discovery, so its promtool rejects
    `kubernetes_sd_configs`; the discovery block is swapped for a static target here and
    its shape is checked in test_the_pieces_agree.
    """
    config_map = next(o for o in load("prometheus.yaml") if o["kind"] == "ConfigMap")
    config = yaml.safe_load(config_map["data"]["prometheus.yml"])
    for scrape in config["scrape_configs"]:
        assert scrape.pop("kubernetes_sd_configs")
        scrape["static_configs"] = [{"targets": ["127.0.0.1:8000"]}]
    path = tmp_path / "prometheus.yml"
    path.write_text(yaml.safe_dump(config))
    result = subprocess.run(
        ["promtool", "check", "config", "--syntax-only", str(path)],
        capture_output=True,
        text=True,
    )
    assert result.returncode == 0, result.stdout + result.stderr
