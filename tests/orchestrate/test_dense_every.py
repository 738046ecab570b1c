"""Dense state with the sparse generation is a first-class option.

``deltarec train --dense-every N``, the pipeline parameter ``dense_every`` and the chart value
``denseEvery`` each reach the trainer's dump hook, which commits the model's dense state with
every N-th dump (docs/serving.md).
"""

import yaml

from deltarec.cli import build_parser, main
from deltarec.cli.cmd_train import _hooks, forwarded_argv
from deltarec.dump.env import TrainSettings
from deltarec.orchestrate import steps
from deltarec.orchestrate.params import PipelineParams, parse_params


def _train_args(argv):
    return build_parser("train").parse_args(["train", *argv])


def test_train_flag_reaches_the_dump_hook_and_every_rank(tmp_path):
    args = _train_args(["--artifacts", str(tmp_path), "--run", "r", "--dense-every", "3"])
    (hook,) = _hooks(args)
    assert hook.dense is not None and hook.dense.every == 3
    argv = forwarded_argv(args)
    assert argv[argv.index("--dense-every") + 1] == "3"
    (plain,) = _hooks(_train_args(["--artifacts", str(tmp_path), "--run", "r"]))
    assert plain.dense is None


def test_train_flag_is_refused_below_one_and_without_artifacts(capsys):
    assert main(["train", "--artifacts", "/tmp/a", "--run", "r", "--dense-every", "0"]) == 2
    assert "dense" in capsys.readouterr().err
    assert main(["train", "--dense-every", "2"]) == 2
    assert "--dense-every" in capsys.readouterr().err


def test_entry_point_settings_carry_dense_every_as_deltarec_dense_every():
    settings = TrainSettings(artifacts="/a", run="r", dense_every=4)
    assert settings.to_env()["DELTAREC_DENSE_EVERY"] == "4"
    assert TrainSettings.from_env(settings.to_env()).hook_arguments()["dense_every"] == 4
    assert "dense_every" not in TrainSettings(artifacts="/a", run="r").hook_arguments()


def _params(**change):
    values = dict(run_name="r", artifact_root="/a", store_url="sqlite:///s.db", steps=50)
    return parse_params(**{**values, **change})


def test_pipeline_parameter_reaches_the_example_model_and_an_entry_point():
    assert PipelineParams.model_fields["dense_every"].default == 0
    args = steps.train_args(_params(dense_every=2))
    assert args[args.index("--dense-every") + 1] == "2"
    assert "--dense-every" not in steps.train_args(_params())
    _, env = steps.torchrun_command(_params(dense_every=2, entry_point="team.train:main"))
    assert env["DELTAREC_DENSE_EVERY"] == "2"
    _, env = steps.torchrun_command(_params(entry_point="team.train:main"))
    assert "DELTAREC_DENSE_EVERY" not in env


def test_compiled_pipeline_takes_dense_every_as_a_parameter(tmp_path):
    out = tmp_path / "p.yaml"
    assert main(["pipeline", "compile", "--output", str(out)]) == 0
    spec = next(yaml.safe_load_all(out.read_text()))
    param = spec["root"]["inputDefinitions"]["parameters"]["dense_every"]
    assert param["defaultValue"] == 0 and param["parameterType"] == "NUMBER_INTEGER"
    assert "dense_every" in spec["root"]["dag"]["tasks"]["params"]["inputs"]["parameters"]
