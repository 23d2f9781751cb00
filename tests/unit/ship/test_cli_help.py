"""`vllm-autotuner --help` everywhere: every flag of every command says what it does and shows
its default."""

from __future__ import annotations

import argparse
import re

import pytest

from vllm_autotuner.cli import build_parser as autotuner_parser


def commands() -> dict[str, argparse.ArgumentParser]:
    found = {}
    parser = autotuner_parser()
    found["vllm-autotuner"] = parser
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                found[f"vllm-autotuner {name}"] = sub
    return found


COMMANDS = commands()
SKIP = (argparse._HelpAction, argparse._VersionAction, argparse._SubParsersAction)


def test_both_programs_and_their_subcommands_are_checked() -> None:
    assert {"vllm-autotuner run", "vllm-autotuner recommend", "vllm-autotuner crds"} <= set(
        COMMANDS
    )


@pytest.mark.parametrize("command", sorted(COMMANDS))
def test_every_flag_has_help_and_shows_its_default(command: str) -> None:
    parser = COMMANDS[command]
    text = " ".join(parser.format_help().split())
    missing_help, missing_default = [], []
    for action in parser._actions:
        if isinstance(action, SKIP) or action.help == argparse.SUPPRESS:
            continue
        name = action.option_strings[0] if action.option_strings else action.dest
        if not action.help:
            missing_help.append(name)
        shown = action.default not in (None, False, [], argparse.SUPPRESS)
        if shown and not re.search(rf"\(default: {re.escape(str(action.default))}\)", text):
            missing_default.append(f"{name}={action.default}")
    assert missing_help == [] and missing_default == []


def test_standalone_is_gone_and_run_defaults_to_it() -> None:
    with pytest.raises(SystemExit):
        autotuner_parser().parse_args(["run", "--standalone"])
    assert autotuner_parser().parse_args(["run"]).peering is None


def test_durations_defaults_are_shown_as_written_and_parsed() -> None:
    args = autotuner_parser().parse_args(["run"])
    assert (args.reconcile_interval, args.prometheus_timeout) == (30.0, 10.0)
    assert "(default: 30s)" in COMMANDS["vllm-autotuner run"].format_help()
