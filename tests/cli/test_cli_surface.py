"""Freeze the command line: every command's name and every flag, with what it takes.

A flag is frozen with whether it is a switch or takes a value (and of what type), its choices,
its default, whether it is required and, for an optional value, what it stands for when given
bare. Adding, removing or renaming a flag, or changing any of these, is a decision: made here,
in the docs and in the changelog of the release.
"""

import argparse
from typing import Any, NamedTuple

import pytest

from deltarec.cli import COMMANDS, build_parser


class F(NamedTuple):
    """What a flag takes: ``switch``, a type name (``str``, ``int``, ``float``), that name
    with ``?`` for an optional value (``const`` when given bare) or with ``+`` for a repeatable
    one."""

    takes: str
    default: Any = None
    choices: tuple[str, ...] | None = None
    required: bool = False
    const: Any = None


LOCATION = {
    "--artifacts": F("str", required=True),
    "--run": F("str", required=True),
    "--store": F("str", required=True),
}
PIPELINE_PARAMS = {
    "--run": F("str", required=True),
    "--artifacts": F("str", required=True),
    "--store": F("str", required=True),
    "--steps": F("int", 1000),
    "--dump-every-steps": F("int", 100),
    "--dump-every-minutes": F("float", 0.0),
    "--publish-mode": F("str", "direct", ("direct", "staged")),
    "--read-p99-ms": F("float", 0.0),
    "--dense-every": F("int", 0),
    "--sample": F("int", 10000),
    "--ranks-per-node": F("int", 2),
    "--nodes": F("int", 1),
    "--gpus-per-node": F("int", 0),
    "--launcher": F("str", "trainjob", ("trainjob", "pytorchjob")),
    "--training-runtime": F("str", "torch-distributed"),
    "--metrics-port": F("int", 0),
    "--verify-partitions": F("int", 1),
    "--compact-min-dumps": F("int", 50),
    "--compact-partition-rows": F("int", 4000000),
    "--gc-mode": F("str", "delete", ("delete", "dry-run", "off")),
    "--gc-keep-promotions": F("int", 3),
    "--checkpoint-dir": F("str", ""),
    "--row-encodings": F("str", ""),
    "--train-args": F("str", ""),
    "--entry-point": F("str", ""),
    "--tables": F("str", ""),
    "--webhook-url": F("str", ""),
}
SECRETS = {"--secret": F("str+"), "--no-secrets": F("switch", False)}

FROZEN: dict[str, dict[str, F]] = {
    "": {"-v/--verbose": F("switch", False)},
    "demo": {
        "--workdir": F("str", "demo-work"),
        "--steps": F("int", 300),
        "--store": F("str"),
        "--engine": F("str", "kfp", ("kfp", "airflow")),
    },
    "train": {
        "--device": F("str", "cpu", ("cpu", "cuda")),
        "--steps": F("int", 300),
        "--batch-size": F("int", 128),
        "--seed": F("int", 0),
        "--batches-per-rank": F("int"),
        "--model-config": F("str"),
        "--eval-every": F("int"),
        "--eval-batches": F("int", 4),
        "--log-every": F("int", 50),
        "--nproc-per-node": F("int"),
        "--workdir": F("str"),
        "--checkpoint-every": F("int"),
        "--no-final-checkpoint": F("switch", False),
        "--no-resume": F("switch", False),
        "--resume-step": F("int"),
        "--export-tables": F("str"),
        "--artifacts": F("str"),
        "--run": F("str"),
        "--dump-every-steps": F("int"),
        "--dump-every-minutes": F("float"),
        "--no-snapshot": F("switch", False),
        "--store": F("str"),
        "--lease-ttl": F("float"),
        "--metrics-port": F("int"),
        "--row-encodings": F("str"),
        "--dense-every": F("int"),
        "--zch-misses": F("switch", False),
        "--read-p99-ms": F("float"),
        "--spread-steps": F("int"),
        "--publish-mode": F("str", "direct", ("direct", "staged")),
    },
    "provision": {
        **LOCATION,
        "--generation": F("int"),
        "--staged": F("switch", False),
        "--json": F("str?", const="-"),
    },
    "publish": {
        **LOCATION,
        "--generation": F("int"),
        "--mode": F("str", "direct", ("direct", "staged")),
        "--ranks": F("str"),
        "--batch-mb": F("float"),
        "--retry-deadline": F("seconds", 600.0),  # a finite float >= 0
        "--read-p99-ms": F("float"),
        "--no-yield-cpu": F("switch", True),  # off: the publisher keeps its CPU priority
        "--metrics-port": F("int"),
        "--json": F("str?", const="-"),
    },
    "verify": {
        **LOCATION,
        "--generation": F("int"),
        "--through-seq": F("int"),
        "--sample": F("sample_size", 10000),  # an int >= 0; 0: every key (docs/verify.md)
        "--all": F("switch", False),
        "--seed": F("int", 0),
        "--json": F("str"),
        "--report": F("str"),
        "--metrics": F("str"),
        "--batch-size": F("positive_int", 8192),
        "--max-mismatches": F("nonnegative_int", 20),
        "--no-record": F("switch", False),
        "--partition": F("str"),
        "--combine": F("str[+]"),
    },
    "promote": {
        **LOCATION,
        "--generation": F("int", required=True),
        "--through-seq": F("int"),
        "--force": F("switch", False),
    },
    "rollback": {
        **LOCATION,
        "--to-generation": F("int", required=True),
        "--through-seq": F("int"),
        "--sample": F("sample_size"),
    },
    "inspect": {
        "--artifacts": F("str", required=True),
        "--run": F("str", required=True),
        "--generation": F("int"),
        "--json": F("switch", False),
    },
    "compact": {
        "--artifacts": F("str", required=True),
        "--run": F("str", required=True),
        "--generation": F("int"),
        "--through-seq": F("int"),
        "--part-rows": F("int"),
        "--tables": F("str"),
        "--key-range": F("str"),
        "--commit": F("switch", False),
        "--busy-share": F("float", 1.0),
        "--json": F("switch", False),
    },
    "gc": {
        "--artifacts": F("str", required=True),
        "--run": F("str", required=True),
        "--store": F("str+", required=True),
        "--keep-promotions": F("int", 3),
        "--checkpoint": F("str+", []),
        "--checkpoints-from": F("str+", []),
        "--dry-run": F("switch", False),
        "--json": F("switch", False),
    },
    "serve": {
        **LOCATION,
        "--device": F("str", "cpu"),
        "--host": F("str", "127.0.0.1"),
        "--port": F("int", 8470),
        "--state-dir": F("str"),
        "--poll-seconds": F("float", 2.0),
        "--checkpoint-seconds": F("float", 60.0),
        "--no-follow": F("switch", False),
        "--no-shadow": F("switch", False),
        "--score": F("switch", False),
        "--model-config": F("str"),
        "--max-connections": F("int", 1024),
        "--max-inflight-mb": F("int", 256),
        "--request-timeout": F("float", 30.0),
    },
    "pipeline compile": {
        "--engine": F("str", "kfp", ("kfp", "airflow")),
        "--output": F("str"),
        "--components": F("str"),
        **SECRETS,
    },
    "pipeline submit": {
        "--host": F("str"),
        "--namespace": F("str"),
        "--experiment": F("str", "deltarec"),
        "--run-label": F("str"),
        "--service-account": F("str"),
        "--pipeline-root": F("str"),
        "--output": F("str"),
        **SECRETS,
        **PIPELINE_PARAMS,
    },
    "pipeline run": {
        "--local": F("switch", False),
        "--engine": F("str", "kfp", ("kfp", "airflow")),
        "--pipeline-root": F("str"),
        "--json": F("str"),
        **PIPELINE_PARAMS,
    },
    "pipeline verify-serving": {
        **LOCATION,
        "--run": F("str"),  # default: every run that serves
        "--sample": F("sample_size", 10000),
        "--json": F("str"),
        "--report": F("str"),
    },
}
"""Command (``""``: the top level, ``pipeline ACTION``: a pipeline action) -> flag -> F."""


def subparser(parser, name):
    action = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return action.choices[name]


def command_parser(command):
    if not command:
        return build_parser()
    name, _, action = command.partition(" ")
    parser = subparser(build_parser(name), name)
    return subparser(parser, action) if action else parser


def described(action):
    """The :class:`F` of an argparse action."""
    if action.nargs == 0:
        takes = "switch"
    else:
        takes = action.type.__name__ if action.type else "str"
        if action.nargs == "?":
            takes += "?"
        elif isinstance(action, argparse._AppendAction):
            takes += "+"
        elif action.nargs is not None:
            takes += f"[{action.nargs}]"
    return F(
        takes,
        action.default,
        tuple(action.choices) if action.choices is not None else None,
        action.required,
        action.const if action.nargs == "?" else None,
    )


def flag_table(parser):
    return {
        "/".join(a.option_strings): described(a)
        for a in parser._actions
        if a.option_strings and "--help" not in a.option_strings
    }


def differences(command, actual, frozen):
    """One line per flag that was added, removed or changed, naming the command and flag."""
    where = f"deltarec {command}".rstrip()
    lines = [f"{where}: {flag} is new: {actual[flag]}" for flag in actual if flag not in frozen]
    lines += [f"{where}: {flag} is gone" for flag in frozen if flag not in actual]
    for flag in actual.keys() & frozen.keys():
        for field in F._fields:
            now, was = getattr(actual[flag], field), getattr(frozen[flag], field)
            if now != was or type(now) is not type(was):
                lines.append(f"{where} {flag}: {field} is {now!r}, frozen as {was!r}")
    return sorted(lines)


def test_cli_command_names_are_frozen():
    assert list(COMMANDS) == [
        "demo",
        "train",
        "provision",
        "publish",
        "verify",
        "promote",
        "rollback",
        "inspect",
        "compact",
        "gc",
        "serve",
        "pipeline",
    ]


def test_every_command_and_pipeline_action_has_a_frozen_flag_table():
    pipeline = subparser(build_parser("pipeline"), "pipeline")
    actions = next(a for a in pipeline._actions if isinstance(a, argparse._SubParsersAction))
    commands = ["", *(c for c in COMMANDS if c != "pipeline")]
    commands += [f"pipeline {action}" for action in actions.choices]
    assert sorted(FROZEN) == sorted(commands)


@pytest.mark.parametrize("command", list(FROZEN))
def test_the_flags_of_every_command_are_frozen(command):
    actual = flag_table(command_parser(command))
    assert differences(command, actual, FROZEN[command]) == []


def test_a_changed_flag_is_reported_by_command_and_flag():
    frozen = dict(FROZEN["train"])
    frozen["--steps"] = F("int", 400)
    frozen["--old-name"] = frozen.pop("--seed")
    assert differences("train", flag_table(command_parser("train")), frozen) == [
        "deltarec train --steps: default is 300, frozen as 400",
        "deltarec train: --old-name is gone",
        "deltarec train: --seed is new: F(takes='int', default=0, choices=None, required=False, "
        "const=None)",
    ]


def test_every_pipeline_parameter_has_a_flag_by_its_name():
    from deltarec.orchestrate.params import PipelineParams

    run = command_parser("pipeline run")
    dests = {a.dest for a in run._actions}
    assert set(PipelineParams.names()) <= dests
