"""Run the Argo CD health checks the way Argo CD does, under Lua 5.1.

Argo CD (gopher-lua, Lua 5.1) runs an argocd-cm health script as a chunk with the resource in the
global `obj`, and opens only the base, package and table libraries plus a safe `os` (time, date)
unless `useOpenLibs` is set (argo-cd util/lua/lua.go, `runLua`). The sandbox below mirrors that,
so a script that needs the string library fails here as it would in Argo CD.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest
import yaml
from lupa.lua51 import LuaError, LuaRuntime

from tests.support import helm
from vllm_autotuner.api.deployment import VLLMDeploymentSpec
from vllm_autotuner.api.policy import VLLMTuningPolicySpec
from vllm_autotuner.api.status import VLLMDeploymentStatus, VLLMTuningPolicyStatus

ROOT = Path(__file__).resolve().parents[3]
CUSTOMIZATIONS = ROOT / "argocd" / "resource_customizations" / "vllm.autotuner.io"
KINDS = ("VLLMDeployment", "VLLMTuningPolicy")
VALID_STATUSES = {"Healthy", "Progressing", "Degraded", "Suspended", "Missing", "Unknown"}

# What Argo CD leaves out of the Lua state when useOpenLibs is false.
SANDBOX = """
string = nil
math = nil
io = nil
debug = nil
coroutine = nil
dofile = nil
loadfile = nil
python = nil
local time, date = os.time, os.date
os = {time = time, date = date}
getmetatable("").__index = nil
"""


def run_health(script: str, obj: dict[str, Any]) -> dict[str, Any]:
    """Evaluate a health.lua chunk for one object in a fresh sandboxed Lua 5.1 state."""
    lua = LuaRuntime(unpack_returned_tuples=True, register_eval=False, register_builtins=False)
    lua.execute(SANDBOX)
    lua.globals().obj = lua.table_from(obj, recursive=True)
    result = lua.execute(script)
    assert result is not None, "health.lua must return a table"
    return dict(result)


def load_cases(kind: str) -> list[tuple[str, dict[str, Any], dict[str, Any]]]:
    kind_dir = CUSTOMIZATIONS / kind
    spec = yaml.safe_load((kind_dir / "health_test.yaml").read_text())
    cases = []
    for test in spec["tests"]:
        obj = yaml.safe_load((kind_dir / test["inputPath"]).read_text())
        cases.append((test["inputPath"], obj, test["healthStatus"]))
    return cases


ALL_CASES = [
    pytest.param(kind, obj, expected, id=f"{kind}:{path}")
    for kind in KINDS
    for path, obj, expected in load_cases(kind)
]


@pytest.mark.parametrize(("kind", "obj", "expected"), ALL_CASES)
def test_health_matches_health_test_yaml(
    kind: str, obj: dict[str, Any], expected: dict[str, str]
) -> None:
    script = (CUSTOMIZATIONS / kind / "health.lua").read_text()
    health = run_health(script, obj)
    assert health["status"] in VALID_STATUSES
    assert health == {"status": expected["status"], "message": expected["message"]}


@pytest.mark.parametrize("kind", KINDS)
def test_every_testdata_file_is_covered(kind: str) -> None:
    """A testdata manifest without an expectation in health_test.yaml would test nothing."""
    kind_dir = CUSTOMIZATIONS / kind
    covered = {path for path, _, _ in load_cases(kind)}
    on_disk = {f"testdata/{p.name}" for p in (kind_dir / "testdata").glob("*.yaml")}
    assert covered == on_disk


def test_the_scenarios_the_gitops_guide_promises_are_covered() -> None:
    """Argo CD users rely on these outcomes (docs/gitops.md): keep a case for each."""
    outcomes = {(expected["status"], path) for path, _, expected in load_cases("VLLMDeployment")}
    statuses = {status for status, _ in outcomes}
    assert {"Healthy", "Progressing", "Degraded"} <= statuses
    by_path = {path: status for status, path in outcomes}
    assert by_path["testdata/tuning-verifying.yaml"] == "Healthy"
    assert by_path["testdata/mode-off.yaml"] == "Healthy"
    assert by_path["testdata/no-status.yaml"] == "Progressing"
    assert by_path["testdata/new-generation.yaml"] == "Progressing"
    policy = {path: expected["status"] for path, _, expected in load_cases("VLLMTuningPolicy")}
    assert {"Healthy", "Degraded", "Progressing"} <= set(policy.values())


@pytest.mark.parametrize(("kind", "obj", "expected"), ALL_CASES)
def test_testdata_is_what_the_operator_would_store(
    kind: str, obj: dict[str, Any], expected: dict[str, str]
) -> None:
    """Testdata must parse with the API models, or the health check is tested on fiction."""
    spec_model = VLLMDeploymentSpec if kind == "VLLMDeployment" else VLLMTuningPolicySpec
    status_model = VLLMDeploymentStatus if kind == "VLLMDeployment" else VLLMTuningPolicyStatus
    assert obj["apiVersion"] == "vllm.autotuner.io/v1alpha1"
    assert obj["kind"] == kind
    spec_model.model_validate(obj["spec"])
    if "status" in obj:
        status = status_model.model_validate(obj["status"])
        types = [c.type for c in status.conditions]
        assert len(types) == len(set(types)), "conditions are a map keyed by type"


def test_sandbox_refuses_the_string_library() -> None:
    """The sandbox must be as strict as Argo CD's, or the tests above prove too little."""
    with pytest.raises(LuaError):
        run_health('local s = string.format("%d", 1) return {status = "Healthy"}', {})
    with pytest.raises(LuaError):
        run_health('local s = ("x"):upper() return {status = "Healthy"}', {})


def test_message_concatenates_numbers_like_lua51() -> None:
    """Lua 5.1 prints 3.0 as "3"; Lua 5.3+ would print "3.0" and break the expected messages."""
    script = (CUSTOMIZATIONS / "VLLMDeployment" / "health.lua").read_text()
    obj = {"metadata": {"generation": 7}, "status": {"observedGeneration": 6.0}}
    assert run_health(script, obj)["message"].endswith("generation 7")


def yaml_blocks(markdown: str) -> list[str]:
    return re.findall(r"```yaml\n(.*?)```", markdown, flags=re.DOTALL)


def test_gitops_guide_snippet_is_the_shipped_lua() -> None:
    """Users paste the argocd-cm snippet from the guide: it must be the tested script."""
    guide = (ROOT / "docs" / "gitops.md").read_text()
    documents = [yaml.safe_load(block) for block in yaml_blocks(guide)]
    (config_map,) = [d for d in documents if d.get("metadata", {}).get("name") == "argocd-cm"]
    for kind in KINDS:
        key = f"resource.customizations.health.vllm.autotuner.io_{kind}"
        assert config_map["data"][key] == (CUSTOMIZATIONS / kind / "health.lua").read_text()


def test_gitops_guide_applications_are_well_formed() -> None:
    guide = (ROOT / "docs" / "gitops.md").read_text()
    applications = [
        d for d in map(yaml.safe_load, yaml_blocks(guide)) if d.get("kind") == "Application"
    ]
    assert len(applications) >= 2
    options = [set(app["spec"]["syncPolicy"]["syncOptions"]) for app in applications]
    assert any("ServerSideApply=true" in o for o in options)
    assert any("SkipDryRunOnMissingResource=true" in o for o in options)
    (operator_app,) = [
        a for a in applications if a["spec"]["source"].get("path") == "charts/vllm-autotuner"
    ]
    values = operator_app["spec"]["source"]["helm"]["valuesObject"]
    assert values["crds"] == {"install": True, "keep": True}
    # The values in the guide must pass the chart's schema.
    assert helm.render_objects(values, api_versions=[helm.MONITORING_API])
