"""The Prometheus launcher of vllm_localcluster (the real binary where it can run)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.support.prometheus import scalar, target_group, wait_for_targets_up
from vllm_localcluster import prometheus as launcher
from vllm_localcluster.prometheus import PrometheusError, PrometheusServer


def test_missing_binary_says_how_to_install(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setattr(launcher, "DEFAULT_BINARY", str(tmp_path / "none"))
    monkeypatch.setenv("PATH", str(tmp_path))
    monkeypatch.delenv("PROMETHEUS_BIN", raising=False)
    with pytest.raises(PrometheusError, match="apt-get install"):
        PrometheusServer(tmp_path)


def test_targets_file_is_replaced_whole(tmp_path: Path) -> None:
    server = PrometheusServer(tmp_path)
    groups = [target_group("127.0.0.1:1234", namespace="ns", pod="p-0")]
    server.set_targets(groups)
    assert json.loads(server.targets_file.read_text()) == groups
    server.set_targets([])
    assert json.loads(server.targets_file.read_text()) == []
    assert [p.name for p in tmp_path.iterdir()] == [server.targets_file.name]  # no temp left


@pytest.mark.prometheus
def test_starts_scrapes_a_file_discovered_target_and_stops(tmp_path: Path) -> None:
    with PrometheusServer(tmp_path / "prom") as server:
        assert server.is_ready()
        assert scalar(server.query("1 + 1")) == 2
        # Prometheus scrapes itself as the target: the discovered labels must be kept.
        own = server.url.removeprefix("http://")
        server.set_targets([target_group(own, namespace="ns", pod="prom-0", job="self")])
        (up,) = wait_for_targets_up(server, 1)
        assert up["metric"]["pod"] == "prom-0" and up["metric"]["job"] == "self"
        process = server.process
        assert process is not None
    assert process.poll() is not None  # stopped
    with pytest.raises(PrometheusError):
        server.query("up")
