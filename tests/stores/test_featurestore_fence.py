"""One writer per run on PAI FeatureStore (test SDK): its registry refuses a superseded
generation before any row reaches the feature view (FeatureStore has no transactions)."""

from __future__ import annotations

import numpy as np
import pytest
from tests._helpers import featurestore as fs_state

from deltarec.artifacts import codec
from deltarec.artifacts.types import TableSpec
from deltarec.errors import StaleGenerationError
from deltarec.ids import make_version
from deltarec.stores import ProgressMark, open_store

T = "sparse.ebc.user_id"
SPEC = {T: TableSpec(dim=4, module_type="EmbeddingBagCollection")}


def test_featurestore_refuses_rows_of_a_generation_older_than_its_registry_has_seen(
    tmp_path, monkeypatch
):
    fs_state.use_test_sdk(monkeypatch, str(tmp_path / "featurestore.db"))
    url = (
        f"featurestore://{fs_state.PROJECT}/{fs_state.VIEW}?region=cn-hangzhou"
        f"&registry=sqlite:///{tmp_path}/reg.db"
    )
    store = open_store(url, run="ctr")
    try:
        store.provision(SPEC)

        def write(keys: list[int], value: float, generation: int) -> None:
            k = np.asarray(keys, np.int64)
            emb = codec.encode(np.full((len(k), 4), value, np.float32), SPEC[T].dtype)
            store.write(
                T, k, emb, np.zeros(len(k), np.int8),
                np.full(len(k), make_version(generation, 1), np.int64),
                mark=ProgressMark("ctr", generation, 1, T, 0, len(k), True),
            )  # fmt: skip

        store.registry.register_generation("ctr", 1)
        write([1, 2], 1.0, generation=1)
        store.registry.register_generation("ctr", 2)
        write([3], 2.0, generation=2)
        with pytest.raises(StaleGenerationError, match="generation 1"):
            write([1, 2, 3], 9.0, generation=1)
        got = store.read(T, np.array([1, 2, 3], np.int64))
        values = codec.decode(got.embedding, SPEC[T].dtype, 4)
        assert values[:, 0].tolist() == [1.0, 1.0, 2.0]  # nothing of the refused write
    finally:
        store.close()
