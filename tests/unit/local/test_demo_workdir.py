"""The demo's scratch directory: every demo starts from an empty cluster."""

from __future__ import annotations

from pathlib import Path

from vllm_localcluster.demo import fresh_workdir


def test_a_second_demo_removes_the_first_ones_cluster_state(tmp_path: Path) -> None:
    said: list[str] = []
    first = fresh_workdir(tmp_path, said.append)
    (first / "controlplane" / "etcd").mkdir(parents=True)
    (first / "controlplane" / "etcd" / "member").write_text("old state")
    (tmp_path / "report.md").write_text("the last report")

    second = fresh_workdir(tmp_path, said.append)

    assert second == first and second.is_dir()
    assert list(second.iterdir()) == []
    assert (tmp_path / "report.md").read_text() == "the last report"
    assert len(said) == 1 and str(second) in said[0]
