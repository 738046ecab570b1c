"""Values no table or retry policy can have are refused naming what and where, before any work."""

from __future__ import annotations

import errno
import json
import socket

import pytest

from deltarec.artifacts import ArtifactRoot
from deltarec.artifacts.types import DumpKind, TableSpec
from deltarec.cli import main
from deltarec.errors import BadInputError, ConfigError
from deltarec.orchestrate.params import parse_params
from deltarec.publish import RetryPolicy
from deltarec.testing.dumps import new_generation, random_rows, write_dump


@pytest.mark.parametrize(
    ("entry", "problem"),
    [
        ('{"dim": -3}', "dim must be at least 1, got -3"),
        ('{"dim": 0}', "dim must be at least 1, got 0"),
        ('{"dim": 4, "num_embeddings": 0}', "num_embeddings must be at least 1, got 0"),
        ('{"dim": 4, "num_embeddings": -5}', "num_embeddings must be"),
    ],
)
def test_a_table_of_no_width_or_no_rows_is_refused_naming_it(tmp_path, entry, problem):
    with pytest.raises(ConfigError, match=r"'m\.t'") as e:
        parse_params(
            run_name="r", artifact_root=str(tmp_path), store_url="sqlite:///s.db",
            tables=f'{{"m.t": {entry}}}',
        )  # fmt: skip
    assert problem in str(e.value)


def test_publish_refuses_a_negative_retry_deadline(tmp_path, capsys):
    with pytest.raises(SystemExit) as e:
        main(["publish", "--artifacts", str(tmp_path), "--run", "r",
              "--store", f"sqlite:///{tmp_path}/s.db", "--retry-deadline", "-1"])  # fmt: skip
    assert e.value.code == 2
    assert "--retry-deadline: -1 must be a duration >= 0 seconds" in capsys.readouterr().err
    with pytest.raises(ConfigError, match="deadline_s must be >= 0"):
        RetryPolicy(deadline_s=-1)


# ---- the bad inputs of a new user: one clear line each, nothing committed changes ------------
T = "sparse.ebc.user_id_hashed_by_country"  # longer than an 80-column table leaves a name
TABLES = {T: TableSpec(dim=4, num_embeddings=100)}


@pytest.fixture
def published(tmp_path):
    """A 2-rank run ``ctr`` (one snapshot) published into a SQLite store: the flags to name it."""
    root = ArtifactRoot(str(tmp_path / "art"))
    info = new_generation(root, "ctr", TABLES, world_size=2)
    rows = {T: {0: random_rows(range(0, 5), TABLES[T]), 1: random_rows(range(5, 9), TABLES[T])}}
    write_dump(root, info, 0, rows, kind=DumpKind.SNAPSHOT)
    flags = ["--artifacts", root.uri, "--run", "ctr", "--store", f"sqlite:///{tmp_path / 's.db'}"]
    assert main(["provision", *flags]) == 0 and main(["publish", *flags]) == 0
    return flags


def one_line(err: str) -> str:
    """The command's error: exactly one line, no traceback."""
    lines = [x for x in err.splitlines() if x.strip()]
    assert len(lines) == 1 and "Traceback" not in err, err
    return lines[0]


def test_verify_all_of_a_truncated_shard_fails_naming_the_shard(published, tmp_path, capsys):
    (shard,) = [p for p in (tmp_path / "art").rglob("rank-00001.parquet")]
    shard.write_bytes(shard.read_bytes()[:100])
    capsys.readouterr()
    assert main(["verify", *published, "--all", "--no-record"]) == 1
    err = capsys.readouterr().err
    line = one_line(err)
    assert line.startswith("deltarec verify: check failed: 1 shard(s) fail their checksum")
    assert str(shard) in line


def test_verify_on_a_read_only_root_writes_its_result_and_names_what_it_could_not(
    published, tmp_path, capsys, monkeypatch
):
    def read_only(self, path, data):
        raise OSError(errno.EROFS, "Read-only file system", path)

    monkeypatch.setattr(ArtifactRoot, "write_bytes_atomic", read_only)
    out = tmp_path / "verify.json"
    capsys.readouterr()
    assert main(["verify", *published, "--all", "--json", str(out)]) == 2
    captured = capsys.readouterr()
    line = one_line(captured.err)
    assert line.startswith("deltarec verify: error: verdict PASSED, but not written: file://")
    assert "/verifications/" in line and "Read-only file system" in line
    assert json.loads(out.read_text())["passed"] is True  # the result is not lost
    assert "verdict: PASSED" in captured.out


def test_publish_of_ranks_the_run_does_not_have_is_refused_writing_nothing(
    published, tmp_path, capsys
):
    store = tmp_path / "s.db"
    before = store.read_bytes()
    capsys.readouterr()
    assert main(["publish", *published, "--ranks", "1,5"]) == 2
    line = one_line(capsys.readouterr().err)
    assert line == (
        "deltarec publish: error: --ranks 1,5: run 'ctr' generation 1 has ranks 0..1, not [5]"
    )
    assert store.read_bytes() == before


@pytest.mark.parametrize("command", ["verify", "promote", "rollback"])
def test_a_mistyped_sqlite_store_path_is_refused_and_not_created(
    published, tmp_path, capsys, command
):
    typo = tmp_path / "s.bd"
    flags = [*published[:-1], f"sqlite:///{typo}"]
    more = {"promote": ["--generation", "1"], "rollback": ["--to-generation", "1"]}
    capsys.readouterr()
    assert main([command, *flags, *more.get(command, [])]) == 2
    line = one_line(capsys.readouterr().err)
    assert line == (
        f"deltarec {command}: error: --store sqlite:///{typo}: the SQLite file {typo} does not "
        "exist (publish or provision creates it)"
    )
    assert not typo.exists()


def test_serve_of_a_run_that_does_not_exist_says_so(published, capsys):
    flags = [*published]
    flags[flags.index("ctr")] = "nosuch"
    capsys.readouterr()
    assert main(["serve", *flags, "--port", "0"]) == 2
    line = one_line(capsys.readouterr().err)
    assert line.startswith("deltarec serve: error: run 'nosuch' does not exist under ")
    assert line.endswith("(runs there: ['ctr'])")


def test_an_entry_point_without_a_colon_is_refused_in_one_line_with_the_fix(tmp_path):
    from deltarec.orchestrate.train_step import check_entry_point

    params = parse_params(
        run_name="r", artifact_root=str(tmp_path), store_url="sqlite:///s.db",
        entry_point="team.train",
    )  # fmt: skip
    with pytest.raises(BadInputError) as e:
        check_entry_point(params)
    assert str(e.value) == (
        "entry point 'team.train': no program 'team.train' on PATH; a function is named "
        "package.module:function, e.g. team.train:main"
    )


def test_a_store_host_that_does_not_resolve_fails_at_once_instead_of_retrying(published, capsys):
    try:
        socket.getaddrinfo("deltarec-test.invalid", None)
    except socket.gaierror as e:
        if e.errno != socket.EAI_NONAME:
            pytest.skip(f"this machine's resolver cannot answer: {e}")
    flags = [*published[:-1], "postgresql://me@deltarec-test.invalid:5432/emb"]
    capsys.readouterr()
    assert main(["publish", *flags]) == 2  # the default retry deadline is 600 s
    line = one_line(capsys.readouterr().err)
    assert line.startswith(
        "deltarec publish: error: --store postgresql://me@deltarec-test.invalid:5432/emb: "
        "host 'deltarec-test.invalid' does not resolve ("
    )


@pytest.mark.parametrize(
    ("flag", "value", "problem"),
    [
        ("--max-mismatches", "-1", "-1 must be >= 0"),
        ("--batch-size", "0", "0 must be >= 1"),
        ("--max-mismatches", "x", "'x' is not a whole number"),
    ],
)
def test_verify_refuses_counts_below_their_minimum(published, capsys, flag, value, problem):
    with pytest.raises(SystemExit) as e:
        main(["verify", *published, flag, value])
    assert e.value.code == 2
    assert f"argument {flag}: {problem}" in capsys.readouterr().err


def test_verify_and_inspect_show_table_names_whole_at_80_columns(published, capsys, monkeypatch):
    monkeypatch.setenv("COLUMNS", "80")
    capsys.readouterr()
    assert main(["verify", *published, "--all", "--no-record"]) == 0
    out = capsys.readouterr().out
    assert f"  {T}: 9 checked (MATCH 9), max |diff| 0" in out
    assert "…" not in out
    assert main(["inspect", *published[:-2]]) == 0
    out = capsys.readouterr().out
    assert f"  {T}: 9 rows, " in out and "…" not in out
    monkeypatch.setenv("COLUMNS", "200")  # wide enough: the table
    assert main(["inspect", *published[:-2]]) == 0
    out = capsys.readouterr().out
    assert "┃ table" in out and f" {T} " in out


def test_pipeline_verify_serving_prints_its_verdict(published, capsys):
    assert main(["verify", *published, "--all"]) == 0
    assert main(["promote", *published, "--generation", "1"]) == 0
    capsys.readouterr()
    assert main(["pipeline", "verify-serving", *published, "--sample", "0"]) == 0
    out = capsys.readouterr().out.strip().splitlines()
    assert out == [
        "verify-serving: run 'ctr' generation 1 through dump 0 (serving): PASS, 9 keys checked"
    ]


def test_a_resume_whose_steps_end_before_its_checkpoint_is_refused(tmp_path, capsys):
    done = tmp_path / "work" / "checkpoints" / "step-00000060"
    done.mkdir(parents=True)
    (done / "COMPLETE").write_text("")
    argv = ["train", "--steps", "40", "--workdir", str(tmp_path / "work")]
    assert main(argv) == 2  # else it restores step 60, trains nothing and exits 0
    line = one_line(capsys.readouterr().err)
    assert line == (
        "deltarec train: error: --steps 40 is below step 60 of the checkpoint this run resumes "
        f"from ({tmp_path / 'work' / 'checkpoints'}): nothing would be trained; give --steps "
        "above 60, or --no-resume to start afresh"
    )


def test_inspect_of_an_unreachable_object_store_is_one_line_naming_the_root(capsys, monkeypatch):
    pytest.importorskip("s3fs")
    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    for name, value in {
        "AWS_ENDPOINT_URL": f"http://127.0.0.1:{port}", "AWS_ACCESS_KEY_ID": "k",
        "AWS_SECRET_ACCESS_KEY": "s", "AWS_MAX_ATTEMPTS": "1", "AWS_DEFAULT_REGION": "us-east-1",
    }.items():  # fmt: skip
        monkeypatch.setenv(name, value)
    assert main(["inspect", "--artifacts", "s3://bucket/art", "--run", "r"]) == 1
    line = one_line(capsys.readouterr().err)
    assert line.startswith(
        "deltarec inspect: failed: cannot reach the artifact root s3://bucket/art: "
        f'Could not connect to the endpoint URL: "http://127.0.0.1:{port}/bucket'
    )
