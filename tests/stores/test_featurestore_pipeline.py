"""``deltarec pipeline run --local`` against PAI FeatureStore through the test SDK.

The pipeline's steps run as processes (KFP's local runner, torchrun ranks); they import the test
``feature_store_py`` through ``PYTHONPATH`` and share its rows through its state file.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
from tests._helpers import featurestore as fs_state
from tests._helpers.dump import read_dump

from deltarec.artifacts import ArtifactRoot, codec
from deltarec.artifacts.lineage import expected_state
from deltarec.artifacts.types import DType, TableKind
from deltarec.cli import main
from deltarec.stores.featurestore.tzrec import tzrec_embedding_name

pytestmark = pytest.mark.multiprocess


def _run_pipeline(
    tmp_path, monkeypatch, capsys, url_options: str, *flags: str
) -> tuple[str, str, str, dict]:
    """``pipeline run --local`` (20 steps, a dump every 10) on a view of the test SDK.

    Returns the SDK's state file, the store URL, the artifact root and the result document.
    """
    state = str(tmp_path / "featurestore.db")
    fs_state.use_test_sdk(monkeypatch, state)
    store = f"featurestore://{fs_state.PROJECT}/{fs_state.VIEW}?region=cn-hangzhou{url_options}"
    art = str(tmp_path / "art")
    out = tmp_path / "result.json"
    code = main([
        "pipeline", "run", "--local", "--run", "fs", "--artifacts", art, "--store", store,
        "--steps", "20", "--dump-every-steps", "10", "--sample", "0", *flags,
        "--pipeline-root", str(tmp_path / "kfp"), "--json", str(out),
    ])  # fmt: skip
    assert code == 0, capsys.readouterr().out[-3000:]
    return state, store, art, json.loads(out.read_text())


def _verify_serving_fails(tmp_path, capsys, art: str, store: str) -> dict:
    """``pipeline verify-serving --sample 0`` exits 1 on exactly one DIFFERENT row, cleanly."""
    capsys.readouterr()
    verify = ["pipeline", "verify-serving", "--artifacts", art, "--run", "fs", "--store", store]
    doc = tmp_path / "verify.json"
    assert main([*verify, "--sample", "0", "--json", str(doc)]) == 1
    assert "Traceback" not in capsys.readouterr().err
    checked = json.loads(doc.read_text())
    assert not checked["passed"] and checked["totals"]["DIFFERENT"] == 1
    return checked


def test_pipeline_with_quantized_rows_on_featurestore_passes_and_a_tampered_row_fails(
    tmp_path, monkeypatch, capsys
):
    state, store, art, result = _run_pipeline(
        tmp_path, monkeypatch, capsys, "", "--row-encodings", "int8_rowwise,sparse.ebc.geo=float16"
    )
    assert result["verdict"] == "PASS" and result["promoted"] == 1
    assert result["metrics"]["keys_checked"] > 0
    assert (tmp_path / "art" / "_registry" / "featurestore-proj-emb.db").exists()
    tables = ArtifactRoot(art).read_generation("fs", 1).tables  # quantized rows, end to end
    assert tables["sparse.ebc.geo"].dtype is DType.FLOAT16
    assert {t.dtype for n, t in tables.items() if n != "sparse.ebc.geo"} == {DType.INT8_ROWWISE}
    stored = fs_state.stored_rows(state, fs_state.PROJECT, fs_state.VIEW, fs_state.VERSION)
    (table, key), value = next(iter(sorted(stored.items())))
    fs_state.set_row(state, fs_state.PROJECT, fs_state.VIEW, fs_state.VERSION, table, key,
                     [v + 1.0 for v in value])  # fmt: skip
    checked = _verify_serving_fails(tmp_path, capsys, art, store)
    assert any("cannot list its keys" in n for n in checked["notes"])


def test_pipeline_on_a_tzrec_view_publishes_ids_never_admitted_with_the_fallback_row(
    tmp_path, monkeypatch, capsys
):
    state, store, art, result = _run_pipeline(tmp_path, monkeypatch, capsys, "&contract=tzrec")
    assert result["verdict"] == "PASS"
    root = ArtifactRoot(art)
    (gen,) = root.list_generations("fs")
    expected = expected_state(root, "fs", gen)
    stored = fs_state.stored_rows(state, fs_state.PROJECT, fs_state.VIEW, fs_state.VERSION)
    never_admitted: list[tuple[str, int]] = []
    for table, exp in expected.tables.items():
        spec = root.read_generation("fs", gen).tables[table]
        name = tzrec_embedding_name(table, spec)  # from the module type GENERATION.json records
        assert name.split(".")[-2] in ("embedding_bags", "embeddings"), name
        rows = {key: value for (pk, key), value in stored.items() if pk == name}
        kind = spec.kind
        # FeatureStore cannot delete: every key with a record has a row, key -1 excepted
        want_keys = exp.keys[exp.keys != -1] if kind is TableKind.ZCH else exp.present_keys()
        assert sorted(rows) == want_keys.tolist(), table
        want = codec.decode(exp.load(want_keys), exp.spec.dtype, exp.spec.dim)
        got = np.array([rows[k] for k in want_keys.tolist()], np.float32)
        np.testing.assert_array_equal(got, want, err_msg=table)  # key by key, exactly
        if kind is TableKind.ZCH:
            held = set()
            for seq in root.list_dumps("fs", gen):
                keys, _, ops, _ = read_dump(root, "fs", gen, seq)[table]
                held.update(keys[ops == 0].tolist())
            never_admitted += [(name, k) for k in exp.keys[exp.ops == 1].tolist() if k not in held]
    assert never_admitted, "no ZCH id was looked up without ever being admitted"
    name, key = never_admitted[0]
    fs_state.set_row(state, fs_state.PROJECT, fs_state.VIEW, fs_state.VERSION, name, key,
                     [v + 1.0 for v in stored[(name, key)]])  # fmt: skip
    _verify_serving_fails(tmp_path, capsys, art, store)
