"""`vllm-autotuner recommend`'s inputs: refusals, one-line policy-file errors, guessed knobs,
and one revision per window."""

from __future__ import annotations

from pathlib import Path

import pytest

from vllm_autotuner import cli
from vllm_autotuner.adapters.promql import SnapshotTarget
from vllm_autotuner.recommend import (
    PolicyFileError,
    RecommendRequest,
    current_knobs,
    load_policy_file,
    one_revision,
    revision_of,
)

BASE = ["recommend", "--prometheus", "http://127.0.0.1:9", "--timeout", "1s"]
SLO = ["--ttft-ms", "500", "--itl-ms", "50"]


def run(argv: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str]:
    try:
        code = cli.main(argv)
    except SystemExit as exc:  # argparse refusals
        code = int(exc.code or 0)
    return code, capsys.readouterr().err


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--gpu", "H999"], "unknown GPU 'H999'"),
        (["--gpu", "H100", "--gpu-memory-utilization", "1.5"], "out of range (0, 1]"),
        (["--gpu", "H100", "--gpu-memory-utilization", "0"], "out of range (0, 1]"),
        (["--gpu", "H100", "--max-num-seqs", "0"], "out of range [1, inf)"),
        (["--gpu", "H100", "--tensor-parallel-size", "-2"], "out of range [1, inf)"),
        (["--gpu", "H100", "--ttft-ms", "-5"], "out of range (0, inf)"),
        (["--gpu", "H100", "--itl-percentile", "100"], "out of range (0, 99.99]"),
        (["--gpu", "H100", "--window", "5"], "not a duration"),
        (["--gpu", "H100", "--max-num-batched-tokens", "many"], "not a number"),
        ([], "--gpu"),
    ],
)
def test_refuses_unknown_gpus_and_out_of_range_values(
    flags: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    code, err = run([*BASE, *SLO, *flags], capsys)
    assert code == 2 and message in err


def write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "policy.yaml"
    path.write_text(text)
    return path


@pytest.mark.parametrize(
    ("text", "message"),
    [
        (None, "No such file or directory"),
        ("slo: [unclosed", "not YAML (line 1)"),
        ("- a\n- b\n", "a mapping is expected"),
        ("kind: VLLMDeployment\nspec: {}\n", "kind is 'VLLMDeployment'"),
        (
            "kind: VLLMTuningPolicy\nspec:\n  slo:\n    ttft: {percentile: 95, thresholdMs: -1}\n",
            "invalid VLLMTuningPolicy: slo.ttft.thresholdMs",
        ),
    ],
)
def test_a_bad_policy_file_is_one_line_not_a_traceback(
    text: str | None, message: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "policy.yaml" if text is None else write(tmp_path, text)
    with pytest.raises(PolicyFileError, match="--policy"):
        load_policy_file(path)
    code, err = run([*BASE, "--gpu", "H100", "--policy", str(path)], capsys)
    assert code == 2
    assert err.startswith(f"error: --policy {path}") and message in err
    assert len(err.strip().splitlines()) == 1


def test_a_good_policy_file_loads(tmp_path: Path) -> None:
    path = write(
        tmp_path,
        "apiVersion: vllm.autotuner.io/v1alpha1\nkind: VLLMTuningPolicy\n"
        "metadata: {name: p}\nspec:\n  slo:\n    itl: {percentile: 95, thresholdMs: 40}\n"
        "    ttft: {percentile: 95, thresholdMs: 900}\n",
    )
    assert load_policy_file(path).slo.ttft.threshold_ms == 900


def request(**knobs: float) -> RecommendRequest:
    return RecommendRequest("http://p", 500, 50, gpu="H100", **knobs)  # type: ignore[arg-type]


def test_knobs_not_given_are_vllm_defaults_and_called_a_guess() -> None:
    knobs, guessed = current_knobs(request())
    assert (knobs.max_num_batched_tokens, knobs.max_num_seqs) == (8192, 1024)
    assert guessed == ("--max-num-batched-tokens", "--max-num-seqs", "--gpu-memory-utilization")
    knobs, guessed = current_knobs(request(max_num_seqs=64))
    assert knobs.max_num_seqs == 64
    assert guessed == ("--max-num-batched-tokens", "--gpu-memory-utilization")
    _, guessed = current_knobs(
        request(max_num_batched_tokens=2048, max_num_seqs=64, gpu_memory_utilization=0.9)
    )
    assert guessed == ()


OLD = ("llama-6d5f8b7c9-abcde", "llama-6d5f8b7c9-fghij")
NEW = ("llama-7f8c9d6b5-klmno", "llama-7f8c9d6b5-pqrst")


def target(*pods: str) -> SnapshotTarget:
    return SnapshotTarget("ns", "llama", tuple(pods), None, None, None, 300.0)


def test_a_pod_s_revision_is_its_replicaset() -> None:
    assert revision_of(OLD[0]) == "llama-6d5f8b7c9"
    assert revision_of("llama-0") == ""  # a StatefulSet's pod: no revision in the name


def test_two_revisions_serving_is_a_rollout_and_nothing_is_judged() -> None:
    pods, _, why = one_revision(target(*OLD, *NEW), alive={OLD[0], *NEW})
    assert pods == () and why is not None and "rollout is under way" in why
    assert "llama-6d5f8b7c9 (1 pods)" in why and "llama-7f8c9d6b5 (2 pods)" in why


def test_an_earlier_revision_that_left_is_excluded_and_named() -> None:
    pods, gone, why = one_revision(target(*OLD, *NEW), alive=set(NEW))
    assert (pods, gone, why) == (NEW, OLD, None)


def test_a_pod_of_the_same_revision_that_left_does_not_cut_the_window() -> None:
    pods, gone, why = one_revision(target(*NEW), alive={NEW[0]})
    assert (pods, gone, why) == ((NEW[0],), (), None)


def test_no_pod_serving_now_is_said() -> None:
    _, _, why = one_revision(target(*OLD), alive=set())
    assert why is not None and "no pod exported metrics" in why
