"""An outside team's torchrec model (examples/dlrm_team: torchrec's DLRM over an
EmbeddingBagCollection and an EmbeddingCollection reading the same feature ``f_item``, its own
data and loop, deltarec's public API only) trained through
``deltarec pipeline run --local``: replaying its artifacts gives its final tables, and verify
passes."""

import os
import pathlib
import sys

import numpy as np
import pytest

from deltarec.artifacts import ArtifactRoot
from deltarec.artifacts.lineage import expected_state
from deltarec.artifacts.types import Op

from .conftest import run_pipeline_locally

pytestmark = pytest.mark.multiprocess

EXAMPLE_SRC = pathlib.Path(__file__).resolve().parents[2] / "examples" / "dlrm_team" / "src"


@pytest.fixture
def team_package(monkeypatch):
    """The team's package importable as if installed in the trainer image."""
    monkeypatch.setenv(
        "PYTHONPATH", os.pathsep.join([str(EXAMPLE_SRC), os.environ.get("PYTHONPATH", "")])
    )
    monkeypatch.syspath_prepend(str(EXAMPLE_SRC))
    yield
    for name in [m for m in sys.modules if m == "dlrm_team" or m.startswith("dlrm_team.")]:
        del sys.modules[name]


def final_tables(export_dir):
    """The team's final tables, rebuilt from every rank's exported shards."""
    parts = {}
    for path in sorted(pathlib.Path(export_dir).glob("rank-*.npz")):
        with np.load(path) as npz:
            for name in npz.files:
                key, _, offsets = name.partition("@")
                row, col = (int(x) for x in offsets.split(","))
                parts.setdefault(key, []).append((row, col, npz[name]))
    tables = {}
    for key, shards in parts.items():
        rows = max(r + a.shape[0] for r, _, a in shards)
        cols = max(c + a.shape[1] for _, c, a in shards)
        full = np.zeros((rows, cols), np.float32)
        for r, c, a in shards:
            full[r : r + a.shape[0], c : c + a.shape[1]] = a
        # <module>.embedding_bags.<table>.weight (EBC), <module>.embeddings.<table>.weight (EC)
        sep = ".embedding_bags." if ".embedding_bags." in key else ".embeddings."
        module, _, rest = key.partition(sep)
        tables[f"{module}.{rest.removesuffix('.weight')}"] = full
    return tables


def test_outside_dlrm_trains_through_the_pipeline_and_its_artifacts_replay_to_its_tables(
    tmp_path, team_package, capsys
):
    from dlrm_team.tables import table_ids, tables_parameter

    art, store = tmp_path / "art", f"sqlite:///{tmp_path / 'store.db'}"
    export = tmp_path / "final"
    result, _ = run_pipeline_locally(
        tmp_path, capsys, "--run", "dlrm", "--artifacts", str(art), "--store", store,
        "--entry-point", "dlrm_team.train:main", "--tables", tables_parameter(),
        "--train-args", f"--export {export} --batch-size 32", "--steps", "24",
        "--dump-every-steps", "8", "--sample", "0",
    )  # fmt: skip
    gen = result["generation"]
    assert result["verdict"] == "PASS" and result["promoted"] == gen["generation"] == 1
    assert gen["last_step"] == 24 and gen["dumps"] >= 4
    assert result["metrics"]["keys_different"] == result["metrics"]["keys_missing"] == 0.0

    tables = final_tables(export)
    assert sorted(tables) == sorted(table_ids())
    state = expected_state(ArtifactRoot(str(art)), "dlrm", gen["generation"])
    assert sorted(state.tables) == sorted(table_ids())
    for table, weights in tables.items():
        replayed = state.tables[table]
        assert (replayed.ops == Op.UPSERT).all()
        # the snapshot wrote every row; every row of the final table is replayed exactly
        np.testing.assert_array_equal(replayed.keys, np.arange(weights.shape[0]))
        np.testing.assert_array_equal(replayed.load(replayed.keys), weights)
