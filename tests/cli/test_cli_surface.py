"""Freeze the flags of ``deltarec pipeline`` and ``deltarec demo``: adding one is a decision."""

import argparse

import pytest

from deltarec.cli import build_parser

PARAMS = {
    "--run", "--artifacts", "--store", "--steps", "--dump-every-steps", "--dump-every-minutes",
    "--publish-mode", "--sample", "--ranks-per-node", "--nodes", "--gpus-per-node",
    "--checkpoint-dir", "--train-args", "--entry-point", "--tables", "--webhook-url",
    "--row-encodings",
}  # fmt: skip
EXPECTED = {
    "compile": {"--engine", "--output", "--components", "--secret", "--no-secrets"},
    "submit": {
        "--host",
        "--namespace",
        "--experiment",
        "--run-label",
        "--service-account",
        "--pipeline-root",
        "--output",
        "--secret",
        "--no-secrets",
    }
    | PARAMS,
    "run": {"--local", "--engine", "--pipeline-root", "--json"} | PARAMS,
    "verify-serving": {"--artifacts", "--run", "--store", "--sample", "--json", "--report"},
}


def subparser(parser, name):
    action = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return action.choices[name]


def flags(parser):
    return {s for a in parser._actions for s in a.option_strings if s not in ("-h", "--help")}


@pytest.mark.parametrize("action", sorted(EXPECTED))
def test_pipeline_flags_are_frozen(action):
    pipeline = subparser(build_parser("pipeline"), "pipeline")
    assert flags(subparser(pipeline, action)) == EXPECTED[action]


def test_demo_flags_are_the_specs():
    demo = subparser(build_parser("demo"), "demo")
    assert flags(demo) == {"--workdir", "--steps", "--store", "--engine"}


def test_every_pipeline_parameter_has_a_flag_by_its_name():
    from deltarec.orchestrate.params import PipelineParams

    run = subparser(subparser(build_parser("pipeline"), "pipeline"), "run")
    dests = {a.dest for a in run._actions}
    assert set(PipelineParams.names()) <= dests
