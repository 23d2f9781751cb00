"""The runs-file format: the calibration set parses, and bad files fail with a useful place."""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

import pytest
import yaml

from vllm_sim.runs import (
    RunsFileError,
    calibration_runs_path,
    check_runs_path,
    fit_runs_paths,
    load_runs,
    parse_runs,
)


def minimal() -> dict[str, Any]:
    return {
        "format": "vllm-sim-runs/v1",
        "defaults": {"gpu": "H100", "knobs": {"max_num_seqs": 64, "max_num_batched_tokens": 512}},
        "workloads": {
            "chat": {
                "system_prompt_tokens": 32,
                "question_tokens": 96,
                "output_tokens": 16,
                "groups": 2,
                "stages": [{"rate": 2, "duration": 10}, {"rate": 4, "duration": 5}],
            }
        },
        "runs": [
            {
                "id": "r1",
                "model": "meta-llama/Llama-2-7b-hf",
                "workload": "chat",
                "knobs": {"max_num_batched_tokens": 1024},
                "results": [
                    {"segment": 0, "ttft_ms": {"p50": 20}, "tpot_ms": {"mean": 7.5}},
                    {"segment": "all", "ok": 30, "sent": 40, "throughput_rps": 2.0},
                ],
            }
        ],
    }


def test_the_calibration_set_parses_with_every_source_a_run() -> None:
    runs = load_runs(calibration_runs_path())
    by_source: dict[str, int] = {}
    for r in runs:
        by_source[r.source.split()[0]] = by_source.get(r.source.split()[0], 0) + 1
    # inference-sim/training: 16 A runs (4 models x 4 profiles).
    assert by_source["A"] == 16
    assert len({r.id for r in runs}) == len(runs)
    for r in runs:
        assert r.results, r.id
        if r.source.startswith("A"):
            assert r.kv_blocks is not None and r.kv_offload
            assert r.client_timeout_s == 300
    overloaded = {r.id for r in runs if r.overloaded}
    assert overloaded == {r.id for r in runs if r.workload.name == "reasoning"}


def test_calibration_workloads_send_the_documented_request_counts() -> None:
    # The inference-sim runs' logs, "Requests" column.
    expected = {"general": 16800, "codegen": 9000, "roleplay": 7200, "reasoning": 4800}
    for r in load_runs(calibration_runs_path()):
        if r.workload.name in expected:
            assert r.workload.total_requests == expected[r.workload.name], r.id


def test_defaults_merge_under_run_keys() -> None:
    [run] = parse_runs(minimal())
    assert run.gpu == "H100"
    assert run.knobs.max_num_seqs == 64  # from defaults
    assert run.knobs.max_num_batched_tokens == 1024  # the run's own value wins
    assert run.knobs.gpu_memory_utilization == 0.9  # the format's default
    assert run.workload.prompt_tokens == 32 + 96  # system + question when not measured
    assert [s.requests for s in run.workload.stages] == [20, 20]
    assert run.results[1].segment is None and run.results[1].label == "all"


def test_json_and_yaml_give_the_same_runs(tmp_path: Path) -> None:
    data = minimal()
    (tmp_path / "a.json").write_text(json.dumps(data))
    (tmp_path / "a.yaml").write_text(yaml.safe_dump(data))
    assert load_runs(tmp_path / "a.json") == load_runs(tmp_path / "a.yaml")


def test_inline_workloads_are_accepted() -> None:
    data = minimal()
    data["runs"][0]["workload"] = copy.deepcopy(data["workloads"]["chat"])
    [run] = parse_runs(data)
    assert run.workload.name == "inline" and run.workload.total_requests == 40


def _set(data: dict[str, Any], path: list[Any], value: object) -> None:
    node: Any = data
    for key in path[:-1]:
        node = node[key]
    if value is KeyError:
        del node[path[-1]]
    else:
        node[path[-1]] = value


@pytest.mark.parametrize(
    ("path", "value", "message"),
    [
        (["runs", 0, "results", 0, "ttft_ms", "p50"], "fast", "runs[0].results[0].ttft_ms.p50"),
        (["runs", 0, "model"], KeyError, "runs[0].model: missing"),
        (["runs", 0, "workload"], "nope", "unknown workload 'nope'"),
        (["runs", 0, "results", 0, "segment"], 2, "runs[0].results[0].segment"),
        (["runs", 0, "results", 1, "ok"], 41, "41 completed of only 40 sent"),
        (["runs", 0, "knobs", "gpu_memory_utilization"], 1.5, "must be <= 1"),
        (["runs", 0, "knobs", "max_num_seqs"], 0, "knobs.max_num_seqs: must be >= 1"),
        (["runs", 0, "tp"], 1.5, "runs[0].tp: expected an integer"),
        (["runs", 0, "colour"], "red", "unknown key(s) colour"),
        (["workloads", "chat", "stages", 1, "rate"], -1, "workloads.chat.stages[1].rate"),
        (["workloads", "chat", "arrival"], "gamma", "only 'poisson'"),
        (["workloads", "chat", "prompt_tokens"], 20, "leaves no room"),
        (["format"], "v0", "expected 'vllm-sim-runs/v1'"),
        (["runs"], [], "runs: expected a non-empty list"),
        (["runs", 0, "knobs", "kv_cache_dtype"], "int3", "kv_cache_dtype: expected one of auto"),
        (["runs", 0, "quantization"], [8], "runs[0].quantization: expected a non-empty string"),
    ],
)
def test_invalid_files_name_the_bad_field(path: list[Any], value: object, message: str) -> None:
    data = minimal()
    _set(data, path, value)
    with pytest.raises(RunsFileError) as err:
        parse_runs(data)
    assert message in str(err.value)


def test_duplicate_run_ids_are_refused() -> None:
    data = minimal()
    data["runs"].append(copy.deepcopy(data["runs"][0]))
    with pytest.raises(RunsFileError, match=r"runs\[1\]\.id: duplicate run id 'r1'"):
        parse_runs(data)


def test_syntax_errors_name_the_file(tmp_path: Path) -> None:
    bad = tmp_path / "broken.yaml"
    bad.write_text("runs: [\n")
    with pytest.raises(RunsFileError, match=r"broken\.yaml"):
        load_runs(bad)


def test_kv_cache_dtype_and_weight_precision_reach_the_replayed_engine() -> None:
    from vllm_sim.replay import engine_config

    data = minimal()
    data["runs"][0]["knobs"]["kv_cache_dtype"] = "fp8"
    data["runs"][0]["quantization"] = "fp8"
    data["runs"][0]["model"] = "meta-llama/Llama-3.1-8B-Instruct"
    [run] = parse_runs(data)
    assert (run.knobs.kv_cache_dtype, run.quantization) == ("fp8", "fp8")
    cfg = engine_config(run)
    assert (cfg.kv_cache_dtype, cfg.quantization) == ("fp8", "fp8")
    [plain] = parse_runs(minimal())
    assert (plain.knobs.kv_cache_dtype, plain.quantization) == ("auto", None)
    assert engine_config(plain).quantization is None


def test_every_shipped_runs_file_parses_and_fit_and_check_sets_are_disjoint() -> None:
    fit = {r.id for f in fit_runs_paths() for r in load_runs(f)}
    check = {r.id for r in load_runs(check_runs_path())}
    assert fit and check and not fit & check
    gpus = {r.gpu for r in load_runs(check_runs_path())}
    assert {"A100-80GB", "L40S", "H100"} <= gpus
    assert {r.gpu for f in fit_runs_paths() for r in load_runs(f)} == {"H100"}


def test_fit_and_check_sets_are_disjoint_and_split_by_gpu() -> None:
    """docs/fidelity.md, "Fit and check": no run (by id or by source row) is in both sets, the
    fit set is H100 only, and every other GPU's runs are held out."""
    fit = [r for p in fit_runs_paths() for r in load_runs(p)]
    check = load_runs(check_runs_path())
    assert {r.id for r in fit}.isdisjoint({r.id for r in check})
    assert {r.source for r in fit}.isdisjoint({r.source for r in check})
    assert {r.gpu for r in fit} == {"H100"}
    assert {"A100-80GB", "L40S"} <= {r.gpu for r in check}
