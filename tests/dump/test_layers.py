"""The tracking layer sits below the dumper, which calls one typed protocol on every source."""

from __future__ import annotations

import inspect
from pathlib import Path

import torch
from tests._helpers.dump import HandTables
from tests._helpers.layers import imported_names

from deltarec.artifacts import TableKind, TableSpec
from deltarec.dump import Dumper, DumperConfig, dumper
from deltarec.tracking.types import TableSource, TouchedRows

TRACKING = Path(dumper.__file__).resolve().parents[1] / "tracking"


def test_the_tracking_layer_imports_nothing_from_the_dumper():
    files = sorted(TRACKING.glob("*.py"))
    assert len(files) >= 8
    offenders = {
        f.name: sorted(
            m for m in imported_names(f) if m == "deltarec.dump" or m.startswith("deltarec.dump.")
        )
        for f in files
    }
    assert {f: m for f, m in offenders.items() if m} == {}


def test_the_dumper_calls_the_source_protocol_without_probing_attributes():
    source = inspect.getsource(dumper)
    assert "getattr(" not in source and "hasattr(" not in source


class _OnlyTheAbstractMethods(TableSource):
    """A source that implements only what the protocol requires (no streams, no hooks)."""

    def __init__(self, weight: torch.Tensor) -> None:
        self.table_id = "m.minimal"
        self.spec = TableSpec(dim=weight.shape[1], kind=TableKind.PLAIN, num_embeddings=len(weight))
        self.weight = weight
        self.touched = torch.empty(0, dtype=torch.int64)

    def collect(self) -> TouchedRows:
        ids, self.touched = torch.unique(self.touched), torch.empty(0, dtype=torch.int64)
        return TouchedRows(ids, self.weight[ids], torch.zeros(len(ids), dtype=torch.int8))

    def snapshot(self, chunk_rows: int):
        for start in range(0, len(self.weight), chunk_rows):
            ids = torch.arange(start, min(start + chunk_rows, len(self.weight)))
            yield TouchedRows(ids, self.weight[ids], torch.zeros(len(ids), dtype=torch.int8))

    def read_keys(self, keys: torch.Tensor) -> TouchedRows:
        return TouchedRows(keys, self.weight[keys], torch.zeros(len(keys), dtype=torch.int8))


def test_a_source_with_only_the_abstract_methods_is_dumped_through_the_protocols_defaults(
    tmp_path,
):
    minimal = _OnlyTheAbstractMethods(torch.randn(300, 4))
    tables = HandTables(seed=21)
    cfg = DumperConfig(artifacts=str(tmp_path), run="p", chunk_rows=64, fsync=False)
    d = Dumper(cfg, [*tables.sources(), minimal])
    d.start(step=0)  # snapshot through dump_snapshot's default
    minimal.touched = torch.tensor([5, 7, 5, 299])
    d.before_eval()  # default hooks: nothing to do, nothing raised
    d.after_eval()
    m = d.final_dump(1)
    d.close()
    snapshot = d._worker.committed[0] if d._worker else None
    assert snapshot is not None and snapshot.tables["m.minimal"] == 300
    assert m.tables["m.minimal"] == 3
