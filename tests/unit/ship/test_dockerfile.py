"""Static checks of the Dockerfile (there is no Docker daemon here, so it is parsed instead).

The rules come from Docker's build best practices and from what Kubernetes enforces: a numeric
non-root USER (the kubelet cannot verify runAsNonRoot for a named user), exec-form ENTRYPOINT (so
SIGTERM reaches kopf), pinned base images, and no build tools left in the images that run.
"""

from __future__ import annotations

import json
import re
import tomllib
from dataclasses import dataclass, field
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[3]
DOCKERFILE = ROOT / "Dockerfile"
FINAL_TARGETS = ("operator", "vllm-sim")
BUILD_TOOLS = ("curl", "wget", "git", "gcc", "g++", "clang", "make", "build-essential", "cmake")


@dataclass
class Stage:
    image: str
    name: str | None
    instructions: list[tuple[str, str]] = field(default_factory=list)

    def args(self, keyword: str) -> list[str]:
        return [value for key, value in self.instructions if key == keyword]


def logical_lines(text: str) -> list[str]:
    """Join continuation lines and drop comments, as Docker's parser does."""
    lines: list[str] = []
    current = ""
    for raw in text.splitlines():
        stripped = raw.strip()
        if stripped.startswith("#") or (not stripped and not current):
            continue
        if stripped.endswith("\\"):
            current += stripped[:-1].rstrip() + " "
            continue
        lines.append((current + stripped).strip())
        current = ""
    if current.strip():
        lines.append(current.strip())
    return [line for line in lines if line]


def substitute(value: str, variables: dict[str, str]) -> str:
    return re.sub(r"\$\{?(\w+)\}?", lambda m: variables.get(m[1], m[0]), value)


def parse(text: str) -> tuple[dict[str, str], list[Stage]]:
    """Global ARG defaults and the stages, FROM images resolved with those defaults."""
    global_args: dict[str, str] = {}
    stages: list[Stage] = []
    for line in logical_lines(text):
        keyword, _, rest = line.partition(" ")
        keyword = keyword.upper()
        rest = rest.strip()
        if keyword == "FROM":
            parts = [p for p in rest.split() if not p.startswith("--platform")]
            image = substitute(parts[0], global_args)
            name = parts[2] if len(parts) >= 3 and parts[1].upper() == "AS" else None
            stages.append(Stage(image=image, name=name))
        elif not stages:
            if keyword == "ARG":
                key, _, default = rest.partition("=")
                global_args[key] = default
        else:
            stages[-1].instructions.append((keyword, rest))
    return global_args, stages


GLOBAL_ARGS, STAGES = parse(DOCKERFILE.read_text())
BY_NAME = {stage.name: stage for stage in STAGES if stage.name}


def final(name: str) -> Stage:
    return BY_NAME[name]


def exec_form(value: str) -> list[str]:
    parsed = json.loads(value)
    assert isinstance(parsed, list) and all(isinstance(p, str) for p in parsed), value
    return parsed


def test_multi_stage_with_the_named_targets() -> None:
    assert len(STAGES) >= 3
    assert {"builder", *FINAL_TARGETS} <= set(BY_NAME)
    # `docker build .` without --target builds the last stage: the operator.
    assert STAGES[-1].name == "operator"


def test_base_images_are_pinned_tags_never_latest() -> None:
    for stage in STAGES:
        if stage.image in BY_NAME:
            continue
        assert "$" not in stage.image, f"unresolved build argument in FROM {stage.image}"
        if "@sha256:" in stage.image:
            continue
        repository, _, tag = stage.image.rpartition(":")
        assert repository and "/" not in tag, f"{stage.image} has no tag"
        assert tag != "latest"


def test_the_base_image_defaults_to_a_digest() -> None:
    """A rebuild gets the same OS until the digest is bumped on purpose."""
    assert re.fullmatch(
        r"python:3\.11-slim-bookworm@sha256:[0-9a-f]{64}", GLOBAL_ARGS["PYTHON_IMAGE"]
    )


def test_the_builder_installs_no_extras_and_leaves_no_installer() -> None:
    (install,) = [v for v in BY_NAME["builder"].args("RUN") if "pip install" in v]
    assert "/wheels/*.whl" in install and "[" not in install  # no extras
    assert "uninstall --yes pip" in install and "uninstall --yes setuptools wheel" in install


def test_final_images_share_the_builder_base() -> None:
    """The copied venv points at the base's interpreter: the paths must match."""
    builder = BY_NAME["builder"]
    for target in FINAL_TARGETS:
        assert final(target).image == builder.image
        assert any(
            value.split()[:1] == ["--from=builder"] and "/opt/venv" in value
            for value in final(target).args("COPY")
        )


@pytest.mark.parametrize("target", FINAL_TARGETS)
def test_final_targets_run_as_a_numeric_non_root_user(target: str) -> None:
    users = final(target).args("USER")
    assert users, f"{target} has no USER"
    match = re.fullmatch(r"(\d+)(?::(\d+))?", users[-1])
    assert match, f"USER {users[-1]} is not numeric"
    assert int(match[1]) != 0
    assert match[2] is None or int(match[2]) != 0


@pytest.mark.parametrize(
    ("target", "entrypoint"),
    [("operator", ["vllm-autotuner", "run"]), ("vllm-sim", ["vllm-sim", "serve"])],
)
def test_entrypoints_are_exec_form_console_scripts(target: str, entrypoint: list[str]) -> None:
    (value,) = final(target).args("ENTRYPOINT")
    assert exec_form(value) == entrypoint
    for cmd in final(target).args("CMD"):
        exec_form(cmd)
    scripts = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["scripts"]
    assert entrypoint[0] in scripts


def test_operator_defaults_to_all_namespaces() -> None:
    (cmd,) = final("operator").args("CMD")
    assert exec_form(cmd) == ["--all-namespaces"]


def test_vllm_sim_exposes_the_vllm_port() -> None:
    exposed = " ".join(final("vllm-sim").args("EXPOSE")).split()
    assert "8000" in exposed


@pytest.mark.parametrize("target", FINAL_TARGETS)
def test_final_targets_environment_and_labels(target: str) -> None:
    env = " ".join(final(target).args("ENV"))
    assert "PYTHONUNBUFFERED=1" in env
    assert "PYTHONDONTWRITEBYTECODE=1" in env
    assert "/opt/venv/bin" in env
    labels = " ".join(final(target).args("LABEL"))
    for key in ("source", "version", "revision", "licenses", "title"):
        assert f"org.opencontainers.image.{key}=" in labels


@pytest.mark.parametrize("target", FINAL_TARGETS)
def test_no_build_tools_in_final_targets(target: str) -> None:
    for value in final(target).args("RUN"):
        words = set(re.split(r"[\s;&|]+", value))
        assert not words & set(BUILD_TOOLS), value


def test_apt_is_used_cleanly_wherever_it_is_used() -> None:
    for stage in STAGES:
        for value in stage.args("RUN"):
            if re.search(r"apt(-get)? install", value):
                assert "--no-install-recommends" in value
                assert "rm -rf /var/lib/apt/lists" in value


def test_builder_copies_only_what_exists_and_is_not_ignored() -> None:
    ignored = {
        line.strip().rstrip("/")
        for line in (ROOT / ".dockerignore").read_text().splitlines()
        if line.strip() and not line.startswith("#")
    }
    assert {".git", ".venv", "tests"} <= ignored
    for value in BY_NAME["builder"].args("COPY"):
        if value.startswith("--"):
            continue
        for source in value.split()[:-1]:
            path = source.rstrip("/")
            assert (ROOT / path).exists(), f"COPY {source}: missing"
            assert path not in ignored, f"COPY {source}: excluded by .dockerignore"


def test_parser_sees_continuations_and_comments() -> None:
    """The checks above are only as good as the parser."""
    args, stages = parse(
        "ARG IMG=python:3.11-slim\n"
        "FROM ${IMG} AS a\n"
        "# a comment\n"
        "RUN apt-get update \\\n    && apt-get install -y curl\n"
        "FROM a AS b\nUSER 10:10\n"
    )
    assert args == {"IMG": "python:3.11-slim"}
    assert [(s.image, s.name) for s in stages] == [("python:3.11-slim", "a"), ("a", "b")]
    assert stages[0].args("RUN") == ["apt-get update && apt-get install -y curl"]
    assert stages[1].args("USER") == ["10:10"]


def test_operator_cli_accepts_the_image_defaults() -> None:
    from vllm_autotuner.cli import build_parser

    (entrypoint,) = final("operator").args("ENTRYPOINT")
    (cmd,) = final("operator").args("CMD")
    args = build_parser().parse_args([*exec_form(entrypoint)[1:], *exec_form(cmd)])
    assert args.command == "run" and args.all_namespaces is True


def test_vllm_sim_image_runs_what_the_operator_renders() -> None:
    """The operator's vLLM container runs `vllm serve ...`; the sim image must accept it."""
    import yaml

    from vllm_autotuner.api.deployment import VLLMDeploymentSpec
    from vllm_autotuner.core.render import Owner, render_deployment
    from vllm_autotuner.core.tuning_types import Knobs
    from vllm_sim.flags import parse_serve_args

    links = [v for v in final("vllm-sim").args("RUN") if re.search(r"\bln -s\b", v)]
    assert any(v.split()[-2:] == ["vllm-sim", "/opt/venv/bin/vllm"] for v in links), links

    example = yaml.safe_load((ROOT / "examples" / "llama-3.1-8b-h100.yaml").read_text())
    spec = VLLMDeploymentSpec.model_validate(example["spec"])
    knobs = Knobs(max_num_batched_tokens=6144, max_num_seqs=192, gpu_memory_utilization=0.88)
    deployment = render_deployment(spec, knobs, Owner(name="x", namespace="y", uid="z"))
    (container,) = deployment["spec"]["template"]["spec"]["containers"]
    assert container["command"][:2] == ["vllm", "serve"]
    options = parse_serve_args([*container["command"][2:], *container["args"]])
    assert str(options.port) in " ".join(final("vllm-sim").args("EXPOSE")).split()
    assert {p["containerPort"] for p in container["ports"]} == {options.port}
    assert options.config.max_num_seqs == knobs.max_num_seqs
    assert options.config.max_num_batched_tokens == knobs.max_num_batched_tokens
    assert options.config.gpu_memory_utilization == knobs.gpu_memory_utilization
