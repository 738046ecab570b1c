"""The pipeline commands' errors a user meets first: one clear line each, exit code 2."""

import socket

from deltarec.cli import main


def _closed_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _params(tmp_path):
    return ["--run", "ctr", "--artifacts", str(tmp_path / "art"),
            "--store", f"sqlite:///{tmp_path / 's.db'}"]  # fmt: skip


def test_submit_to_an_unreachable_host_is_one_line_and_exit_2(tmp_path, capsys):
    host = f"http://127.0.0.1:{_closed_port()}"
    assert main(["pipeline", "submit", "--host", host, "--no-secrets", *_params(tmp_path)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1, err
    assert err[0].startswith(f"deltarec pipeline: error: the KFP endpoint {host} cannot be reached")


def test_a_bad_entry_point_is_one_line_and_exit_2_before_anything_runs(tmp_path, capsys):
    for entry, problem in (
        ("no_such_team.train:main", "module 'no_such_team.train' is not importable here"),
        ("json:no_such_function", "json has no callable 'no_such_function'"),
    ):
        code = main(["pipeline", "run", "--local", "--entry-point", entry, *_params(tmp_path),
                     "--pipeline-root", str(tmp_path / "kfp")])  # fmt: skip
        err = capsys.readouterr().err.strip().splitlines()
        assert code == 2 and len(err) == 1, err
        assert f"entry point {entry!r}" in err[0] and problem in err[0]
    assert not (tmp_path / "kfp").exists() and not (tmp_path / "art").exists()
