"""Credentials never travel in URLs: refused at any depth, masked in whatever is printed."""

from __future__ import annotations

import logging

import pytest

from deltarec.cli import RedactingFormatter, build_parser, main
from deltarec.credentials import check_no_credentials, redact_text, redact_url
from deltarec.errors import ConfigError
from deltarec.orchestrate.params import parse_params
from deltarec.stores import parse_store_url

SECRET = "S3cr3tValue"
NESTED = f"featurestore://proj/view?region=cn-hangzhou&registry=postgresql://reg:{SECRET}@db/reg"
PARAMS = {"run_name": "ctr", "artifact_root": "/tmp/a", "store_url": "sqlite:///s.db"}


@pytest.mark.parametrize(
    "url",
    [
        f"postgresql://u@h/db?password={SECRET}",
        f"postgresql://u@h/db?sslpassword={SECRET}",
        f"redis://h:6379/0?token={SECRET}",
        f"featurestore://p/v?region=r&access_key={SECRET}",
        NESTED,
        f"featurestore://p/v?region=r&registry=postgresql://reg@db/reg?password={SECRET}",
    ],
)
def test_a_store_url_with_a_credential_option_or_a_nested_password_is_refused_unprinted(url):
    with pytest.raises(ConfigError, match="environment") as e:
        parse_store_url(url)
    assert SECRET not in str(e.value)


def test_a_top_level_postgres_password_still_parses_and_is_masked_when_printed():
    url = f"postgresql://u:{SECRET}@h/db"
    assert parse_store_url(url).password == SECRET  # type: ignore[union-attr]
    assert redact_url(url) == "postgresql://u:***@h/db"


def test_the_not_a_url_error_does_not_echo_what_was_given():
    with pytest.raises(ConfigError, match="not a URL") as e:
        parse_store_url(f"u:{SECRET}@db/emb")
    assert SECRET not in str(e.value)


def test_redaction_masks_passwords_secret_options_and_nested_urls_and_keeps_the_rest():
    assert redact_url(NESTED) == (
        "featurestore://proj/view?region=cn-hangzhou&registry=postgresql://reg:***@db/reg"
    )
    assert (
        redact_url(f"s3://b/x?X-Amz-Signature={SECRET}&a=1") == "s3://b/x?X-Amz-Signature=***&a=1"
    )
    assert redact_url("redis://h:6379/0?prefix=emb:") == "redis://h:6379/0?prefix=emb:"
    text = redact_text(
        f"got postgresql://u:{SECRET}@h/db and u:{SECRET}@h/db and 'x://h?key={SECRET}'"
    )
    assert SECRET not in text and text.count("***") == 3


@pytest.mark.parametrize("field", ["store_url", "artifact_root", "webhook_url", "train_extra_args"])
def test_pipeline_parameters_refuse_a_credential_anywhere_without_printing_it(field):
    value = {
        "store_url": NESTED,
        "artifact_root": f"s3://bucket/root?secret_key={SECRET}",
        "webhook_url": f"https://hooks.example/x?token={SECRET}",
        "train_extra_args": f"--lr 0.1 --teacher postgresql://u:{SECRET}@db/t",
    }[field]
    with pytest.raises(ConfigError, match=field) as e:
        parse_params(**{**PARAMS, field: value})
    assert SECRET not in str(e.value)


def test_check_no_credentials_passes_a_url_that_only_names_a_user():
    check_no_credentials("store_url", "postgresql://trainer@db:5432/emb?layout=bytea")


def test_unrecognized_arguments_are_echoed_with_their_credentials_masked(capsys):
    with pytest.raises(SystemExit) as e:
        build_parser("inspect").parse_args(
            ["inspect", "--artifacts", "/a", "--run", "r", f"postgresql://u:{SECRET}@h/db"]
        )
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert "unrecognized arguments: postgresql://u:***@h/db" in err and SECRET not in err


def test_a_bad_store_option_error_from_a_command_does_not_print_the_value(capsys, tmp_path):
    store = f"postgresql://u@127.0.0.1:1/db?password={SECRET}"
    code = main(["promote", "--artifacts", str(tmp_path), "--run", "r",
                 "--generation", "1", "--store", store])  # fmt: skip
    out = capsys.readouterr()
    assert code == 2 and "'password' holds a credential" in out.err
    assert SECRET not in out.out + out.err


def test_log_records_of_any_library_are_masked():
    record = logging.LogRecord(
        "botocore.endpoint", logging.INFO, __file__, 1, "to %s", (f"redis://u:{SECRET}@h/0",), None
    )
    assert RedactingFormatter("%(message)s").format(record) == "to redis://u:***@h/0"


def test_verbose_raises_only_deltarecs_own_loggers(tmp_path, capsys):
    root = logging.getLogger()
    saved = root.handlers[:], root.level, logging.getLogger("deltarec").level
    root.handlers = []
    try:
        main(["-v", "inspect", "--artifacts", str(tmp_path), "--run", "r"])
        assert logging.getLogger("deltarec").getEffectiveLevel() == logging.DEBUG
        assert logging.getLogger("botocore").getEffectiveLevel() >= logging.INFO
        assert logging.getLogger("urllib3").getEffectiveLevel() >= logging.INFO
    finally:
        root.handlers, root.level = saved[0], saved[1]
        logging.getLogger("deltarec").setLevel(saved[2])


def test_train_hands_its_ranks_the_store_url_in_the_environment_not_on_the_command_line():
    from deltarec.cli.cmd_train import RANK_STORE_ENV, rank_argv_and_env

    store = f"postgresql://u:{SECRET}@h/db"
    args = build_parser("train").parse_args(
        ["train", "--artifacts", "/a", "--run", "r", "--store", store, "--nproc-per-node", "2"]
    )
    argv, env = rank_argv_and_env(args)
    assert SECRET not in " ".join(argv) and "--store" not in argv and "--run" in argv
    assert env == {RANK_STORE_ENV: store}


def test_an_uncaught_crash_of_a_command_prints_its_traceback_masked(tmp_path):
    import subprocess
    import sys

    code = (
        "import sys; from deltarec import cli\n"
        "def boom(args): raise RuntimeError('cannot reach postgresql://u:' + 'S3cr3tValue@h/db')\n"
        "cli._command_module('inspect').run = boom\n"
        "sys.exit(cli.main())\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", code, "inspect", "--artifacts", str(tmp_path), "--run", "r"],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert done.returncode == 1
    assert "RuntimeError: cannot reach postgresql://u:***@h/db" in done.stderr
    assert SECRET not in done.stderr
