"""`vllm-autotuner pause|resume|promote|abort|retry` write annotations on a VLLMDeployment
through the API (the real API server), and nothing else."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.support.cluster_api import CR, CR_PATH, NS, POLICY, POLICY_PATH, Api, ApiServer
from tests.support.cluster_api import api as api
from vllm_autotuner import cli
from vllm_autotuner.core.commands import PAUSE_ANNOTATION, REQUEST_ANNOTATIONS

NAME = CR["metadata"]["name"]


def annotations(api: Api) -> dict[str, str]:
    body = api.get(f"{CR_PATH}/{NAME}") or {}
    return dict(body["metadata"].get("annotations") or {})


def test_commands_write_and_remove_annotations(
    apiserver: ApiServer,
    api: Api,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    api.create(POLICY_PATH, POLICY)
    created = api.create(CR_PATH, CR)
    kubeconfig = apiserver.write_kubeconfig(tmp_path / "kubeconfig", NS)
    base = ["--kubeconfig", str(kubeconfig)]

    assert cli.main(["pause", NAME, *base]) == 0  # the context's namespace
    assert annotations(api)[PAUSE_ANNOTATION] == "true"
    assert "the operator acts on its next reconcile" in capsys.readouterr().out

    assert cli.main(["retry", NAME, "-n", NS, *base]) == 0
    first = annotations(api)[REQUEST_ANNOTATIONS["retry"]]
    assert cli.main(["retry", NAME, "-n", NS, *base]) == 0
    assert annotations(api)[REQUEST_ANNOTATIONS["retry"]] > first  # a new request each time

    assert cli.main(["resume", NAME, *base]) == 0
    after = annotations(api)
    assert PAUSE_ANNOTATION not in after
    assert (
        after["argocd.argoproj.io/tracking-id"]
        == CR["metadata"]["annotations"]["argocd.argoproj.io/tracking-id"]
    )  # the user's own annotations stay
    body = api.get(f"{CR_PATH}/{NAME}") or {}
    assert body["metadata"]["generation"] == created["metadata"]["generation"]  # not spec


def test_an_unknown_deployment_is_one_clear_line(
    apiserver: ApiServer,
    api: Api,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    kubeconfig = apiserver.write_kubeconfig(tmp_path / "kubeconfig", NS)
    assert cli.main(["promote", "nope", "--kubeconfig", str(kubeconfig)]) == 1
    err = capsys.readouterr().err.strip()
    assert err == f"error: VLLMDeployment {NS}/nope: not found"
