"""Property-based fuzzing of the API models and of rendering.

Whatever JSON arrives (admission can be bypassed or out of date), the models either accept it or
raise ValidationError — never another exception — and an accepted spec renders a Deployment
whose argv carries no NUL or line break and no second value for a flag the operator owns.
"""

from __future__ import annotations

import contextlib
import copy
import itertools
import re
from typing import Any, cast

import pytest
from hypothesis import HealthCheck, assume, find, given, settings
from hypothesis import strategies as st
from pydantic import ValidationError

from tests.unit.security.corpus import DEPLOYMENT, POLICY
from tests.unit.security.test_owned_flags import could_set_owned
from vllm_autotuner.api.deployment import (
    CONFIG_FLAG,
    MODEL_PATTERN,
    OWNED_FLAGS,
    SERVED_MODEL_NAME_PATTERN,
    VLLMDeploymentSpec,
)
from vllm_autotuner.api.policy import VLLMTuningPolicySpec
from vllm_autotuner.core import render
from vllm_autotuner.core.starting_point import starting_knobs

FUZZ = settings(
    max_examples=150,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
)
KNOB_FLAGS = ("max-num-batched-tokens", "max-num-seqs", "gpu-memory-utilization")
POLICY_SPEC = VLLMTuningPolicySpec.model_validate(POLICY["spec"])

json_scalars = (
    st.none()
    | st.booleans()
    | st.integers(min_value=-(2**70), max_value=2**70)
    | st.floats(allow_nan=True, allow_infinity=True)
    | st.text(max_size=40)
)
json_values = st.recursive(
    json_scalars,
    lambda children: (
        st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=12), children, max_size=4)
    ),
    max_leaves=20,
)
SPEC_KEYS = sorted(VLLMDeploymentSpec.model_json_schema(by_alias=True)["properties"])


def flag_spellings() -> st.SearchStrategy[str]:
    """Owned flags (and --config) as an attacker would write them: whole or abbreviated, dashes
    or underscores, with or without a value, joined with '=' or standing alone."""
    return st.builds(
        lambda name, cut, underscore, value: (
            "--"
            + (name[: max(1, cut)].replace("-", "_") if underscore else name[: max(1, cut)])
            + (f"={value}" if value else "")
        ),
        st.sampled_from((*OWNED_FLAGS, CONFIG_FLAG)),
        st.integers(min_value=1, max_value=40),
        st.booleans(),
        st.one_of(st.just(""), st.text(max_size=8)),
    )


extra_args = st.lists(
    st.one_of(st.text(max_size=30), flag_spellings(), st.from_regex(r"--[a-z-]{1,30}(=\w*)?")),
    max_size=6,
)


def owned_override(arg: str) -> str | None:
    """The owned flag `arg` would set in vLLM's argparse (dashes and underscores are the same,
    '=' splits a value), or None."""
    m = re.match(r"^--([A-Za-z0-9_-]+)(=|$)", arg)
    if not m:
        return None
    name = m.group(1).replace("_", "-")
    return name if name in OWNED_FLAGS else None


def rendered_args(spec: VLLMDeploymentSpec) -> list[str]:
    knobs = starting_knobs(spec, POLICY_SPEC).knobs
    owner = render.Owner(name="llama", namespace="team-a", uid="u")
    deployment = render.render_deployment(spec, knobs, owner)
    container = deployment["spec"]["template"]["spec"]["containers"][0]
    assert container["command"] == ["vllm", "serve"]
    args: list[str] = container["args"]
    return args


# ------------------------------------------------------------------ arbitrary JSON


@FUZZ
@given(json_values)
def test_arbitrary_json_is_accepted_or_a_validation_error(value: Any) -> None:
    for model in (VLLMDeploymentSpec, VLLMTuningPolicySpec):
        with contextlib.suppress(ValidationError):
            model.model_validate(value)


@FUZZ
@given(st.sampled_from(SPEC_KEYS), json_values)
def test_a_valid_spec_with_one_field_replaced_never_crashes(key: str, value: Any) -> None:
    spec = copy.deepcopy(DEPLOYMENT["spec"])
    spec[key] = value
    try:
        parsed = VLLMDeploymentSpec.model_validate(spec)
    except ValidationError:
        return
    args = rendered_args(parsed)
    assert not any(ch in a for a in args for ch in "\x00\r\n")


@FUZZ
@given(st.sampled_from(sorted(VLLMTuningPolicySpec.model_json_schema(by_alias=True)["properties"])), json_values)  # fmt: skip  # noqa: E501
def test_a_valid_policy_with_one_field_replaced_never_crashes(key: str, value: Any) -> None:
    spec = copy.deepcopy(POLICY["spec"])
    spec[key] = value
    with contextlib.suppress(ValidationError):
        VLLMTuningPolicySpec.model_validate(spec)


# ------------------------------------------------------------------ what is accepted renders safely

valid_specs = st.fixed_dictionaries(
    {"model": st.from_regex(MODEL_PATTERN, fullmatch=True).filter(lambda s: len(s) <= 253)},
    optional={
        "servedModelName": st.from_regex(SERVED_MODEL_NAME_PATTERN, fullmatch=True).filter(
            lambda s: len(s) <= 253
        ),
        "engine": st.fixed_dictionaries({"extraArgs": extra_args}),
        "replicas": st.integers(min_value=0, max_value=64),
        "knobs": st.fixed_dictionaries(
            {},
            optional={
                "maxNumSeqs": st.integers(min_value=1, max_value=1024),
                "gpuMemoryUtilization": st.floats(min_value=0.3, max_value=0.99),
            },
        ),
    },
)


def _accepted(raw: dict[str, Any]) -> VLLMDeploymentSpec:
    try:
        return VLLMDeploymentSpec.model_validate(raw)
    except ValidationError:
        assume(False)
        raise


@FUZZ
@given(valid_specs)
def test_accepted_specs_render_args_without_owned_overrides(raw: dict[str, Any]) -> None:
    spec = _accepted(raw)
    args = rendered_args(spec)
    assert not any(ch in a for a in args for ch in "\x00\r\n")
    extras = list(spec.engine.extra_args)
    assert args[len(args) - len(extras) :] == extras  # verbatim, in order, at the end
    assert [a for a in extras if could_set_owned(a)] == []  # not even by abbreviation
    for flag in KNOB_FLAGS:
        assert sum(owned_override(a) == flag for a in args) == 1


@FUZZ
@given(valid_specs)
def test_accepted_specs_round_trip(raw: dict[str, Any]) -> None:
    """What the operator reads back from its own rendering is what the spec said."""
    spec = _accepted(raw)
    again = VLLMDeploymentSpec.model_validate(spec.model_dump(by_alias=True))
    assert again == spec
    args = rendered_args(spec)
    knobs = starting_knobs(spec, POLICY_SPEC).knobs
    assert args[0] == spec.model
    values = dict(itertools.pairwise(args))
    assert values["--max-num-batched-tokens"] == str(knobs.max_num_batched_tokens)
    assert values["--max-num-seqs"] == str(knobs.max_num_seqs)
    assert float(values["--gpu-memory-utilization"]) == pytest.approx(
        knobs.gpu_memory_utilization, abs=5e-4
    )
    if spec.served_model_name:
        assert values["--served-model-name"] == spec.served_model_name


def test_the_strategy_reaches_accepted_specs_with_extra_args() -> None:
    """Guard against a vacuous property: accepted specs with extra args are generated."""

    def accepted_with_args(raw: dict[str, Any]) -> bool:
        try:
            spec = VLLMDeploymentSpec.model_validate(raw)
        except ValidationError:
            return False
        return len(spec.engine.extra_args) >= 2 and spec.served_model_name is not None

    found = cast(
        dict[str, Any], find(valid_specs, accepted_with_args, settings=settings(max_examples=2000))
    )
    assert found["engine"]["extraArgs"]
