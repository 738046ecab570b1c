"""Values no table or retry policy can have are refused naming what and where, before any work."""

from __future__ import annotations

import pytest

from deltarec.cli import main
from deltarec.errors import ConfigError
from deltarec.orchestrate.params import parse_params
from deltarec.publish import RetryPolicy


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
