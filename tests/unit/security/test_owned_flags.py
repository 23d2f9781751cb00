"""extraArgs cannot reach an owned flag through argparse's abbreviations or through --config.

vLLM's parser (argparse with ``allow_abbrev``) lets an unambiguous prefix of a long option select
it, turns underscores into dashes, and reads a YAML file of flags with ``--config``. The rule that
stops all of it is applied three times: the CRD's CEL rule at admission, the pydantic validator on
every reconcile, and render() before the argv is built. Each test here drives all three and
compares them with ``could_set_owned``, a plain-string restatement of the rule written apart from
the regular expression the three share.
"""

from __future__ import annotations

import copy
import math
import re

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from pydantic import ValidationError

from tests.support.crd_validation import crd_schema, evaluate_rule, validate
from tests.unit.security.corpus import DEPLOYMENT, NEAR_MISS_ARGS
from vllm_autotuner.api.crds import deployment_crd
from vllm_autotuner.api.deployment import (
    CONFIG_FLAG,
    EXTRA_ARG_KEEPS_MEANING,
    EXTRA_ARG_NOT_OWNED,
    OWNED_FLAG_PATTERN,
    OWNED_FLAGS,
    SHORT_OWNED_FLAGS,
    VLLMDeploymentSpec,
    sets_owned_flag,
)
from vllm_autotuner.core import render
from vllm_autotuner.core.tuning_types import Knobs

CRD = deployment_crd()
ITEM_SCHEMA = crd_schema(CRD)["properties"]["spec"]["properties"]["engine"]["properties"][
    "extraArgs"
]
REFUSED_NAMES = (*OWNED_FLAGS, CONFIG_FLAG)
KNOBS = Knobs(max_num_batched_tokens=4096, max_num_seqs=128, gpu_memory_utilization=0.9)
OWNER = render.Owner(name="llama", namespace="team-a", uid="u")
PROPERTY = settings(max_examples=150, deadline=None)

# Real vLLM 0.33 flags (vLLM arg_utils.py and `vllm serve --help`) that must stay usable.
LEGIT_FLAGS = (
    "max-logprobs",
    "max-loras",
    "max-lora-rank",
    "max-cpu-loras",
    "max-seq-len-to-capture",
    "max-num-queued-reqs",
    "max-num-queued-tokens",
    "max-cudagraph-capture-size",
    "max-parallel-loading-workers",
    "enforce-eager",
    "trust-remote-code",
    "disable-log-requests",
    "disable-log-stats",
    "enable-chunked-prefill",
    "enable-lora",
    "enable-sleep-mode",
    "speculative-config",
    "compilation-config",
    "kv-transfer-config",
    "kv-events-config",
    "hf-config-path",
    "config-format",
    "model-impl",
    "model-loader-extra-config",
    "tokenizer",
    "tokenizer-mode",
    "seed",
    "swap-space",
    "scheduling-policy",
    "performance-mode",
    "prefix-caching-hash-algo",
    "quantization",
    "load-format",
    "download-dir",
    "optimization-level",
    "async-scheduling",
    "stream-interval",
    "watermark",
    "generation-config",
    "collect-detailed-traces",
    "cpu-offload-gb",
    "code-revision",
    "revision",
)


def could_set_owned(arg: str) -> bool:
    """The rule in plain string operations: a long option whose name (up to ``=`` or ``.``,
    underscores read as dashes) is a non-empty prefix of an owned flag or of "config"; or a
    short option that starts like an owned one."""
    if arg.startswith("--"):
        name = re.split(r"[=.]", arg[2:], maxsplit=1)[0].replace("_", "-")
        return name != "" and any(flag.startswith(name) for flag in REFUSED_NAMES)
    if arg.startswith("-") and len(arg) > 1:
        return any(arg[1] == short[0] for short in SHORT_OWNED_FLAGS)
    return False


def admitted(args: list[str]) -> bool:
    obj = copy.deepcopy(DEPLOYMENT)
    obj["spec"]["engine"] = {"extraArgs": args}
    messages = [v.message for v in validate(CRD, obj)]
    # A prefix of an owned flag may also be a prefix of a flag refused for changing what the
    # knobs mean (test_meaning_flags.py); both messages say why.
    allowed = (EXTRA_ARG_NOT_OWNED.message, EXTRA_ARG_KEEPS_MEANING.message)
    assert all(m in allowed for m in messages), messages
    return not messages


def validated(args: list[str]) -> bool:
    try:
        VLLMDeploymentSpec.model_validate({**DEPLOYMENT["spec"], "engine": {"extraArgs": args}})
    except ValidationError as error:
        assert EXTRA_ARG_NOT_OWNED.message in str(error) or (
            EXTRA_ARG_KEEPS_MEANING.message in str(error)
        )
        return False
    return True


def rendered(args: list[str]) -> bool:
    """render() given the args as if admission and validation had been bypassed."""
    spec = VLLMDeploymentSpec.model_validate(DEPLOYMENT["spec"])
    spec.engine.extra_args.extend(args)
    try:
        deployment = render.render_deployment(spec, KNOBS, OWNER)
    except ValueError as error:
        assert "the operator owns that flag" in str(error)
        return False
    argv = deployment["spec"]["template"]["spec"]["containers"][0]["args"]
    assert argv[len(argv) - len(args) :] == args
    return True


def spelled(name: str, underscores: list[bool]) -> str:
    """``name`` with each dash kept or written as an underscore, as vLLM accepts both."""
    parts = name.split("-")
    out = parts[0]
    for part, underscore in zip(parts[1:], underscores, strict=False):
        out += ("_" if underscore else "-") + part
    return out


@st.composite
def abbreviations(draw: st.DrawFn) -> list[str]:
    """An owned flag (or config) cut to any non-empty prefix, spelled in any way vLLM parses,
    as one element or with its value in the next."""
    flag = draw(st.sampled_from(REFUSED_NAMES))
    prefix = flag[: draw(st.integers(1, len(flag)))]
    name = spelled(prefix, draw(st.lists(st.booleans(), min_size=prefix.count("-"))))
    form = draw(st.sampled_from(["alone", "eq", "dotted", "split"]))
    if form == "split":
        return ["--" + name, "1"]
    return ["--" + name + {"alone": "", "eq": "=1", "dotted": ".key=1"}[form]]


# ------------------------------------------------------------------ every prefix is refused


def test_every_prefix_of_every_owned_flag_is_refused_by_the_pattern() -> None:
    """Exhaustive over names, both spellings: cheap, so no sampling."""
    missed = [
        spelling
        for flag in REFUSED_NAMES
        for n in range(1, len(flag) + 1)
        for spelling in ("--" + flag[:n], "--" + flag[:n].replace("-", "_"))
        if not sets_owned_flag(spelling) or not sets_owned_flag(spelling + "=1")
    ]
    assert missed == []


@PROPERTY
@given(abbreviations())
def test_abbreviations_are_refused_at_admission_by_the_models_and_by_render(
    args: list[str],
) -> None:
    assert could_set_owned(args[0])
    assert not admitted(args)
    assert not validated(args)
    assert not rendered(args)


@pytest.mark.parametrize(
    "args",
    [
        ["--max-num-seq=1"],
        ["--max_num_seq=1"],
        ["--gpu-mem", "0.99"],
        ["--conf=x.yaml"],
        ["--config", "x.yaml"],
        ["--c", "x.yaml"],
        ["-tp", "8"],
        ["-tp=8"],
        ["-tp8"],
        ["-t", "8"],
        ["--enforce-eager", "--max-"],
    ],
    ids=lambda args: " ".join(args),
)
def test_the_brief_cases_are_refused_everywhere(args: list[str]) -> None:
    assert any(could_set_owned(a) for a in args)
    assert (admitted(args), validated(args), rendered(args)) == (False, False, False)


# ------------------------------------------------------------------ real flags still pass


@PROPERTY
@given(
    st.lists(
        st.builds(
            lambda flag, underscore, value: (
                "--" + (flag.replace("-", "_") if underscore else flag) + value
            ),
            st.sampled_from(LEGIT_FLAGS),
            st.booleans(),
            st.sampled_from(["", "=1", "=x.yaml", ".key=1"]),
        ),
        min_size=1,
        max_size=6,
        unique=True,
    )
)
def test_real_flags_that_abbreviate_no_owned_flag_pass_all_three(args: list[str]) -> None:
    assert not any(could_set_owned(a) for a in args)
    assert admitted(args)
    assert validated(args)
    assert rendered(args)


def test_the_near_misses_pass_all_three() -> None:
    args = list(NEAR_MISS_ARGS)
    assert not any(could_set_owned(a) for a in args)
    assert (admitted(args), validated(args), rendered(args)) == (True, True, True)


def test_no_legit_flag_is_a_prefix_of_an_owned_one() -> None:
    """The one way the rule could refuse a real flag: its whole name abbreviates an owned one.
    (vLLM's old --device was such a flag; it is refused on purpose, see api/deployment.py.)"""
    clashes = [f for f in LEGIT_FLAGS if any(o.startswith(f) for o in REFUSED_NAMES)]
    assert clashes == []


# ------------------------------------------------------------------ the regex is the rule


def _agree(arg: str) -> None:
    assert sets_owned_flag(arg) == could_set_owned(arg)
    verdict = evaluate_rule(EXTRA_ARG_NOT_OWNED.rule, ITEM_SCHEMA["items"], arg)
    assert verdict is (not could_set_owned(arg)), verdict


@settings(max_examples=400, deadline=None)
@given(
    st.one_of(
        st.from_regex(r"\A--?[a-z_]{0,12}([=.][a-z0-9=.]{0,4})?\n?\Z"),
        st.text(alphabet="-_=.\nabcdefgikmnoprstuvxyz", max_size=16),
        st.text(max_size=12),
    )
)
def test_pattern_and_cel_agree_with_the_plain_rule(arg: str) -> None:
    _agree(arg)


@pytest.mark.parametrize("arg", ["--max\n", "--max\nx", "-t\n", "--", "--=x", "-", ""])
def test_pattern_and_cel_agree_on_edges(arg: str) -> None:
    """Python's `$` also matches before a final newline, RE2's does not."""
    _agree(arg)


# ------------------------------------------------------------------ the CEL rule stays cheap


def test_cel_cost_estimate_of_the_rule_stays_within_the_api_servers_budget() -> None:
    """The API server refuses a CRD whose rule's estimated cost, times how many times it can run,
    exceeds StaticEstimatedCostLimit = 10,000,000 (k8s apiextensions-apiserver,
    pkg/apiserver/schema/cel). cel-go estimates ``s.matches(re)`` as
    ceil(0.1 * maxLength(s)) * ceil(0.25 * len(re)) (checker/cost.go: StringTraversalCostFactor,
    RegexStringLengthCostFactor). The pattern grows with the owned names; keep 10x headroom."""
    items = ITEM_SCHEMA["maxItems"]
    max_length = ITEM_SCHEMA["items"]["maxLength"]
    per_call = math.ceil(0.1 * max_length) * math.ceil(0.25 * len(OWNED_FLAG_PATTERN))
    assert items * per_call < 10_000_000 // 10


def test_the_message_says_why() -> None:
    message = EXTRA_ARG_NOT_OWNED.message
    assert "owns" in message and "prefix" in message and "--config" in message
    assert "abbreviations" in message
