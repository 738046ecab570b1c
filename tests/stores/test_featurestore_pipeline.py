"""``deltarec pipeline run --local`` against PAI FeatureStore through the test SDK.

The pipeline's steps run as processes (KFP's local runner, torchrun ranks); they import the test
``feature_store_py`` through ``PYTHONPATH`` and share its rows through its state file.
"""

from __future__ import annotations

import json

import pytest
from tests._helpers import featurestore as fs_state

from deltarec.artifacts import ArtifactRoot
from deltarec.artifacts.types import DType
from deltarec.cli import main

pytestmark = pytest.mark.multiprocess


def test_pipeline_with_quantized_rows_on_featurestore_passes_and_a_tampered_row_fails(
    tmp_path, monkeypatch, capsys
):
    state = str(tmp_path / "featurestore.db")
    fs_state.use_test_sdk(monkeypatch, state)
    store = f"featurestore://{fs_state.PROJECT}/{fs_state.VIEW}?region=cn-hangzhou"
    art = str(tmp_path / "art")
    out = tmp_path / "result.json"
    code = main([
        "pipeline", "run", "--local", "--run", "fs", "--artifacts", art, "--store", store,
        "--steps", "20", "--dump-every-steps", "10", "--sample", "0",
        "--row-encodings", "int8_rowwise,sparse.ebc.geo=float16",
        "--pipeline-root", str(tmp_path / "kfp"), "--json", str(out),
    ])  # fmt: skip
    assert code == 0, capsys.readouterr().out[-3000:]
    result = json.loads(out.read_text())
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
    capsys.readouterr()
    verify = ["pipeline", "verify-serving", "--artifacts", art, "--run", "fs", "--store", store]
    doc = tmp_path / "verify.json"
    assert main([*verify, "--sample", "0", "--json", str(doc)]) == 1
    assert "Traceback" not in capsys.readouterr().err
    checked = json.loads(doc.read_text())
    assert not checked["passed"] and checked["totals"]["DIFFERENT"] == 1
    assert any("cannot list its keys" in n for n in checked["notes"])
