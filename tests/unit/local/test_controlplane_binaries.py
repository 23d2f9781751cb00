"""Where the control plane's binaries come from: the cache key, KUBEBUILDER_ASSETS, ldflags."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from vllm_localcluster.controlplane import binaries

SRC = binaries.source_dir()


def copy_module(tmp_path: Path) -> Path:
    src = tmp_path / "controlplane"
    (src / "etcd").mkdir(parents=True)
    for name in binaries.KEYED_FILES:
        shutil.copy(SRC / name, src / name)
    return src


def test_the_module_pins_a_release_of_1_33_or_later_with_every_staging_module_replaced() -> None:
    version = binaries.kubernetes_version()
    major, minor = (int(part) for part in version.lstrip("v").split(".")[:2])
    assert (major, minor) >= (1, 33)
    go_mod = (SRC / "go.mod").read_text()
    staging = f"v0.{minor}.{version.split('.')[2]}"
    replaced = [line for line in go_mod.splitlines() if "=> k8s.io/" in line]
    assert len(replaced) >= 25
    assert all(line.rstrip().endswith(staging) for line in replaced), replaced


def test_the_cache_key_follows_go_sum(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("VLLM_CONTROLPLANE_CACHE", str(tmp_path / "cache"))
    src = copy_module(tmp_path)
    before = binaries.cache_dir(src)
    assert before.parent == tmp_path / "cache"
    assert before.name.startswith(binaries.kubernetes_version(src) + "-")
    with (src / "go.sum").open("a") as go_sum:
        go_sum.write("example.com/x v1.0.0 h1:changed=\n")
    assert binaries.cache_dir(src) != before


def test_kubebuilder_assets_provide_what_they_hold_and_the_cache_the_rest(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("VLLM_CONTROLPLANE_CACHE", str(tmp_path / "cache"))
    src = copy_module(tmp_path)
    assets = tmp_path / "assets"
    assets.mkdir()
    for name in ("etcd", "kube-apiserver"):  # what envtest's assets hold
        (assets / name).write_text("#!/bin/sh\n")
        (assets / name).chmod(0o755)
    monkeypatch.setenv("KUBEBUILDER_ASSETS", str(assets))
    with pytest.raises(binaries.MissingBinaries, match="kube-controller-manager"):
        binaries.find(src)
    cached = binaries.cache_dir(src)
    cached.mkdir(parents=True)
    for name in ("kube-controller-manager", "kube-scheduler"):
        (cached / name).write_text("#!/bin/sh\n")
    found = binaries.find(src)
    assert found.etcd == assets / "etcd" and found.apiserver == assets / "kube-apiserver"
    assert found.controller_manager == cached / "kube-controller-manager"


def test_ldflags_stamp_the_release_into_both_version_packages() -> None:
    flags = binaries.ldflags("v1.33.13")
    for package in ("k8s.io/component-base/version", "k8s.io/client-go/pkg/version"):
        assert f"-X {package}.gitVersion=v1.33.13" in flags
        assert f"-X {package}.gitMinor=33" in flags
    assert flags.startswith("-s -w")
