"""A retrain under a new run name takes serving over in the same store, and rollback returns it.

As a team ships it: run ``one`` trains (2 ranks, publishing while it trains) and is promoted;
run ``two`` (another seed) trains into the same store while ``one`` serves, is verified,
promoted, and serving is rolled back to ``one`` (docs/runs.md's take-over, with its scheduled
checks of who serves). After each step the rows serving reads are
compared, key by key, with the final tables (``--export-tables``) of the run that serves, and
each run's own rows with its own final tables.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import pytest

from deltarec.cli import main
from deltarec.stores import open_store

pytestmark = pytest.mark.multiprocess


def _train(tmp_path: Path, run: str, seed: int, store: str) -> Path:
    export = tmp_path / f"export-{run}"
    cmd = [
        sys.executable, "-c", "import sys; from deltarec.cli import main; sys.exit(main())",
        "train", "--nproc-per-node", "2", "--steps", "24", "--batch-size", "32",
        "--seed", str(seed), "--workdir", str(tmp_path / f"work-{run}"),
        "--artifacts", str(tmp_path / "art"), "--run", run, "--store", store,
        "--dump-every-steps", "8", "--export-tables", str(export), "--log-every", "100",
    ]  # fmt: skip
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, (done.stdout[-2000:], done.stderr[-4000:])
    return export


def _final_tables(export: Path) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    out = {}
    for path in sorted(export.glob("*.parquet")):
        t = pq.read_table(path)
        keys = np.asarray(t.column("key").to_numpy(), np.int64)
        rows = np.stack(t.column("embedding").to_numpy(zero_copy_only=False)).astype(np.float32)
        out[path.name.removesuffix(".parquet")] = (keys, rows)
    return out


def _assert_reads(url: str, run: str | None, tables) -> None:
    """The rows ``run`` (None: serving) reads equal ``tables`` for every key they hold."""
    with open_store(url, run=run) as store:
        assert set(store.views()) == set(tables)
        for table, (keys, rows) in tables.items():
            got = store.read(table, keys)
            assert got.found.all(), f"{run} {table}: {int((~got.found).sum())} keys absent"
            np.testing.assert_array_equal(got.embedding, rows, err_msg=f"{run} {table}")
            held = np.sort(np.concatenate([*store.scan_keys(table), np.empty(0, np.int64)]))
            np.testing.assert_array_equal(held, np.sort(keys), err_msg=f"{run} {table} keys")


def _cli(*args: str) -> int:
    return main(list(args))


def test_a_new_run_takes_serving_over_and_rollback_returns_it_key_by_key(tmp_path, capsys):
    store = f"sqlite:///{tmp_path}/store.db"
    common = ["--artifacts", str(tmp_path / "art"), "--store", store]
    one = _final_tables(_train(tmp_path, "one", seed=1, store=store))
    assert _cli("verify", *common, "--run", "one", "--all") == 0
    assert _cli("promote", *common, "--run", "one", "--generation", "1") == 0
    _assert_reads(store, None, one)

    two = _final_tables(_train(tmp_path, "two", seed=2, store=store))
    _assert_reads(store, "two", two)  # every row of two kept, though one's versions are higher
    _assert_reads(store, None, one)  # serving still reads one
    json_path = tmp_path / "verify-two.json"
    assert _cli("verify", *common, "--run", "two", "--all", "--json", str(json_path)) == 0
    totals = json.loads(json_path.read_text())["totals"]
    assert totals["MATCH"] > 0 and totals["SUPERSEDED"] == 0, totals

    assert _cli("promote", *common, "--run", "two", "--generation", "1") == 0
    _assert_reads(store, None, two)
    # docs/runs.md: the scheduled check follows who serves, and names it
    capsys.readouterr()
    assert _cli("pipeline", "verify-serving", *common, "--sample", "0") == 0
    out = capsys.readouterr().out
    assert "verify-serving: run 'two' generation 1 through dump 4 (serving): PASS" in out
    assert _cli("pipeline", "verify-serving", *common, "--run", "one") == 1
    err = capsys.readouterr().err
    assert "run 'one' does not serve: serving is run 'two' generation 1 dump 4" in err

    assert _cli("rollback", *common, "--run", "one", "--to-generation", "1") == 0
    out = capsys.readouterr().out
    assert "serving before: run 'two' generation 1 dump 4" in out
    assert "serving after: run 'one' generation 1 dump 4" in out and ": equal" in out
    _assert_reads(store, None, one)
    _assert_reads(store, "two", two)  # two's rows stay as they were
    assert _cli("pipeline", "verify-serving", *common, "--sample", "0") == 0
    out = capsys.readouterr().out
    assert "verify-serving: run 'one' generation 1 through dump 4 (serving): PASS" in out
