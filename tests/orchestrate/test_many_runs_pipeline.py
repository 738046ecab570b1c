"""The pipelines ship a retrain: a run other than the serving one takes serving over (docs/runs.md).

Run ``one`` goes through the KFP pipeline (kfp.local), run ``two`` through the Airflow DAG
(its local run), both into one SQLite store; then ``deltarec rollback`` returns serving to
``one``. After each step the rows serving reads equal, key by key, the expected state of the
run that serves, and each run's own rows stay its own.
"""

from __future__ import annotations

import numpy as np
import pytest

from deltarec.artifacts import ArtifactRoot
from deltarec.artifacts.lineage import expected_state
from deltarec.cli import main
from deltarec.stores import open_store

from .conftest import run_pipeline_locally

pytestmark = pytest.mark.multiprocess


def _serves(store_url: str, root: ArtifactRoot, run: str, handle: str | None = None) -> None:
    """What ``handle`` (None: serving) reads equals ``run``'s expected state, key by key."""
    state = expected_state(root, run, root.latest_generation(run))
    with open_store(store_url, run=handle) as store:
        if handle is None:
            assert set(store.registry.serving_runs().values()) == {run}
        for table, et in state.tables.items():
            keys = et.present_keys()
            got = store.read(table, keys)
            assert got.found.all(), f"{run} {table}: {int((~got.found).sum())} keys absent"
            np.testing.assert_array_equal(got.embedding, et.load(keys), err_msg=table)


def test_a_second_run_takes_serving_over_through_the_pipelines_and_rolls_back(tmp_path, capsys):
    store = f"sqlite:///{tmp_path / 'store.db'}"
    art = str(tmp_path / "art")
    root = ArtifactRoot(art)
    common = ["--artifacts", art, "--store", store, "--steps", "20", "--dump-every-steps", "10"]
    one, _ = run_pipeline_locally(
        tmp_path / "one", capsys, "--run", "one", "--train-args", "--seed 1", *common
    )
    assert one["verdict"] == "PASS" and one["promoted"] == 1
    _serves(store, root, "one")

    two, _ = run_pipeline_locally(
        tmp_path / "two",
        capsys,
        "--engine",
        "airflow",
        "--run",
        "two",
        "--train-args",
        "--seed 2",
        *common,
    )
    assert two["verdict"] == "PASS" and two["promoted"] == 1, two
    assert two["metrics"]["keys_superseded"] == 0 and two["metrics"]["keys_match"] > 0
    _serves(store, root, "two")
    _serves(store, root, "one", handle="one")  # one's rows are still its own

    assert main(["rollback", "--artifacts", art, "--run", "one", "--store", store,
                 "--to-generation", "1"]) == 0  # fmt: skip
    _serves(store, root, "one")
    _serves(store, root, "two", handle="two")
