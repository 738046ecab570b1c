"""``deltarec train``: every flag documented and forwarded to the ranks, bad input, and a real
torchrun launch."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from deltarec.cli import build_parser, main
from deltarec.cli.cmd_train import _hooks, forwarded_argv


def _train_parser():
    parser = build_parser("train")
    sub = next(a for a in parser._actions if a.dest == "command")
    return sub.choices["train"]


def _flags(parser):
    return [a for a in parser._actions if a.option_strings and "--help" not in a.option_strings]


def test_every_train_flag_is_documented():
    """The flag set itself is frozen in tests/cli/test_cli_surface.py."""
    train = _train_parser()
    help_text = train.format_help()
    for action in _flags(train):
        assert action.help, f"{action.option_strings} has no help text"
        assert action.option_strings[-1] in help_text


def _set_every_flag(parser):
    """An argv that gives every flag a value of its own (switches on, another choice)."""
    argv = []
    for i, action in enumerate(_flags(parser)):
        flag = action.option_strings[-1]
        if action.nargs == 0:
            argv.append(flag)
        elif action.choices:
            argv += [flag, next(c for c in action.choices if c != action.default)]
        elif action.type is int:
            argv += [flag, str(11 + i)]
        elif action.type is float:
            argv += [flag, str(0.25 + i)]
        else:
            argv += [flag, f"value-{i}"]
    return argv


def test_every_train_flag_but_nproc_is_forwarded_to_the_ranks_with_its_value():
    argv = _set_every_flag(_train_parser())
    args = build_parser("train").parse_args(["train", *argv])
    unset = [a.dest for a in _flags(_train_parser()) if getattr(args, a.dest) in (None, False)]
    assert unset == []
    forwarded = forwarded_argv(args)
    for action in _flags(_train_parser()):
        flag = action.option_strings[-1]
        expected = 0 if flag == "--nproc-per-node" else 1
        assert forwarded.count(flag) == expected, f"train {flag} forwarded {forwarded.count(flag)}x"
    again = build_parser("train").parse_args(["train", *forwarded])
    assert again.nproc_per_node is None
    assert {k: v for k, v in vars(again).items() if k != "nproc_per_node"} == {
        k: v for k, v in vars(args).items() if k != "nproc_per_node"
    }


def test_forwarded_argv_of_the_defaults_is_the_defaults():
    args = build_parser("train").parse_args(["train", "--nproc-per-node", "2"])
    assert forwarded_argv(args) == ["--device", "cpu", "--steps", "300", "--batch-size", "128",
                                    "--seed", "0", "--eval-batches", "4", "--log-every", "50",
                                    "--publish-mode", "direct"]  # fmt: skip
    again = build_parser("train").parse_args(["train", *forwarded_argv(args)])
    assert vars(again) == {**vars(args), "nproc_per_node": None}


def test_forwarded_argv_round_trips_a_realistic_command_line():
    argv = [
        "train", "--steps", "7", "--batch-size", "3", "--workdir", "w", "--checkpoint-every", "2",
        "--eval-every", "5", "--export-tables", "x", "--artifacts", "a", "--run", "r",
        "--dump-every-steps", "4", "--dump-every-minutes", "0.1", "--store", "sqlite:///s.db",
        "--publish-mode", "staged", "--no-snapshot", "--no-resume", "--nproc-per-node", "2",
        "--row-encodings", "float16,sparse.zch.ad_id=int8_rowwise", "--lease-ttl", "1e-3",
    ]  # fmt: skip
    args = build_parser("train").parse_args(argv)
    again = build_parser("train").parse_args(["train", *forwarded_argv(args)])
    assert again.nproc_per_node is None
    assert {k: v for k, v in vars(again).items() if k != "nproc_per_node"} == {
        k: v for k, v in vars(args).items() if k != "nproc_per_node"
    }


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--checkpoint-every", "5"], "checkpoint_every needs workdir"),
        (["--run", "demo"], "--run need(s) --artifacts"),
        (["--artifacts", "/tmp/a"], "--artifacts needs --run"),
        (["--steps", "-1"], "steps"),
        (["--model-config", "/nonexistent/m.json"], "--model-config"),
        (["--row-encodings", "int8"], "--row-encodings need(s) --artifacts"),
        (["--zch-misses"], "--zch-misses need(s) --artifacts"),
        (["--artifacts", "/tmp/a", "--run", "r", "--row-encodings", "int9"], "unknown encoding"),
        (
            ["--artifacts", "/tmp/a", "--run", "r", "--row-encodings", "no.such=float16"],
            "unknown tables ['no.such']",
        ),
    ],
)
def test_bad_train_flags_exit_2_naming_the_problem(argv, message, capsys):
    assert main(["train", *argv]) == 2
    assert message in capsys.readouterr().err


@pytest.mark.parametrize(
    ("flags", "store", "want"),
    [
        ([], None, False),
        (["--zch-misses"], None, True),
        ([], "featurestore://p/v?region=cn-hangzhou&contract=tzrec", True),
        ([], "sqlite:///x.db", False),
    ],
)
def test_zch_misses_reach_the_dumper_from_the_flag_or_a_tzrec_store(tmp_path, flags, store, want):
    argv = ["train", "--artifacts", str(tmp_path), "--run", "r", *flags]
    args = build_parser("train").parse_args(argv + (["--store", store] if store else []))
    (hook,) = _hooks(args)
    assert hook.config.zch_misses is want


def test_int8_rows_of_an_odd_dim_are_refused_naming_the_table(tmp_path, capsys):
    model = tmp_path / "model.json"
    table = {"num_embeddings": 100, "dim": 17, "sharding": "table_wise"}
    model.write_text(json.dumps({"tables": {"user_id": table}}))
    argv = ["train", "--model-config", str(model), "--artifacts", str(tmp_path / "a"), "--run",
            "r", "--row-encodings", "int8_rowwise"]  # fmt: skip
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert "sparse.ebc.user_id" in err and "dim 17" in err and "even dim" in err


def test_unknown_model_config_key_is_rejected(tmp_path, capsys):
    path = tmp_path / "model.json"
    path.write_text(json.dumps({"tables": {}, "hiden": 3}))
    assert main(["train", "--model-config", str(path)]) == 2
    assert "hiden" in capsys.readouterr().err


@pytest.mark.multiprocess
def test_train_nproc_per_node_starts_torchrun_and_exports(tmp_path: Path):
    model = tmp_path / "model.json"
    model.write_text(json.dumps({"zch": {"zch_size_per_rank": 16, "raw_id_space": 10000}}))
    cmd = [
        sys.executable, "-m", "deltarec.cli", "train", "--nproc-per-node", "2", "--steps", "20",
        "--batch-size", "16", "--workdir", str(tmp_path / "w"), "--export-tables",
        str(tmp_path / "export"), "--model-config", str(model), "--log-every", "10",
    ]  # fmt: skip
    cmd[1:3] = ["-c", "import sys; from deltarec.cli import main; sys.exit(main())"]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, (done.stdout[-2000:], done.stderr[-4000:])
    assert "trained steps 0..20" in done.stdout
    assert "step 20/20" in done.stderr
    assert (tmp_path / "w" / "checkpoints" / "step-00000020" / "COMPLETE").is_file()
    exported = sorted(p.name for p in (tmp_path / "export").iterdir())
    assert len(exported) == 7 and "sparse.zch.ad_id.parquet" in exported


def test_torchrun_command_keeps_train_flags_away_from_torchrun_parser():
    from torch.distributed.run import get_args_parser

    from deltarec.train.launch import torchrun_command

    train_args = ["--run", "demo", "--steps", "3", "--nproc-per-node", "9"]
    cmd = torchrun_command(2, train_args)
    parsed = get_args_parser().parse_args(cmd[3:])
    assert parsed.nproc_per_node == "2" and parsed.module and parsed.standalone
    assert parsed.training_script == "deltarec.train"
    assert [a for a in parsed.training_script_args if a != "--"] == train_args
