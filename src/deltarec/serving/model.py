"""A model's scores from the replica: its dense state and its embedding rows of one point.

:class:`ServingModel` takes an unsharded instance of the training program's model (its
embedding modules may be on ``meta``: their weights are never used), replaces every
EmbeddingBagCollection, EmbeddingCollection and ManagedCollisionEmbeddingBagCollection with a
module that looks its ids up in the replica (table id = the module's path + ``.`` + the
torchrec table name, as the dumps name it), and loads the dense state the replica serves.
:meth:`ServingModel.score` pins one snapshot for the whole forward pass, so dense and sparse
come from exactly one promoted point.

Lookups follow the serving semantics of SPEC §4: a ZCH table answers an id it does not hold
with key ``-1``'s row (the fallback row of rank 0 for a row-wise sharded ZCH table), a plain
table with its row. Pooling: SUM and MEAN; per-sample weights are not supported.
"""

from __future__ import annotations

import threading
from typing import Any

import torch
from torch import nn
from torchrec import EmbeddingBagCollection, EmbeddingCollection, KeyedJaggedTensor, KeyedTensor
from torchrec.modules.embedding_configs import PoolingType
from torchrec.modules.mc_embedding_modules import ManagedCollisionEmbeddingBagCollection
from torchrec.sparse.jagged_tensor import JaggedTensor

from deltarec.serving.replica import Replica, Snapshot
from deltarec.serving.table import decode_rows
from deltarec.serving.types import NotReadyError, Position, ReplicaError


class _Lookup(nn.Module):
    """Common part: rows of a feature's ids from the snapshot being scored."""

    def __init__(self, owner: ServingModel, features: list[tuple[str, str, int, PoolingType]]):
        super().__init__()
        self._owner = [owner]  # a list: not a submodule
        self.features = features  # (feature, table id, dim, pooling)

    def _rows(self, table: str, ids: torch.Tensor) -> torch.Tensor:
        snap = self._owner[0].snapshot
        state = snap.table(table)
        rows, _ = state.lookup(ids)
        return decode_rows(rows, state.spec)

    def _pooled(self, kjt: KeyedJaggedTensor) -> KeyedTensor:
        out = []
        for feature, table, _dim, pooling in self.features:
            jt = kjt[feature]
            rows = self._rows(table, jt.values())
            lengths = jt.lengths().long().to(rows.device)
            batch = lengths.numel()
            sample = torch.repeat_interleave(torch.arange(batch, device=rows.device), lengths)
            total = torch.zeros(batch, rows.shape[1], dtype=rows.dtype, device=rows.device)
            total = total.index_add(0, sample, rows)
            if pooling == PoolingType.MEAN:
                total = total / lengths.clamp(min=1).unsqueeze(1).to(rows.dtype)
            out.append(total)
        return KeyedTensor(
            keys=[f for f, _, _, _ in self.features],
            length_per_key=[d for _, _, d, _ in self.features],
            values=torch.cat(out, 1),
        )


class _ReplicaEBC(_Lookup):
    def forward(self, features: KeyedJaggedTensor) -> KeyedTensor:
        return self._pooled(features)


class _ReplicaMCEBC(_Lookup):
    def forward(self, features: KeyedJaggedTensor) -> tuple[KeyedTensor, None]:
        return self._pooled(features), None


class _ReplicaEC(_Lookup):
    def forward(self, features: KeyedJaggedTensor) -> dict[str, JaggedTensor]:
        out = {}
        for feature, table, _dim, _ in self.features:
            jt = features[feature]
            out[feature] = JaggedTensor(values=self._rows(table, jt.values()), lengths=jt.lengths())
        return out


def _bag_features(prefix: str, ebc: EmbeddingBagCollection) -> list[tuple[str, str, int, Any]]:
    return [
        (f, f"{prefix}.{c.name}", c.embedding_dim, c.pooling)
        for c in ebc.embedding_bag_configs()
        for f in c.feature_names
    ]


def _replacement(owner: ServingModel, name: str, module: nn.Module) -> _Lookup | None:
    if isinstance(module, ManagedCollisionEmbeddingBagCollection):
        inner = module._embedding_module
        assert isinstance(inner, EmbeddingBagCollection)
        return _ReplicaMCEBC(owner, _bag_features(name, inner))
    if isinstance(module, EmbeddingBagCollection):
        return _ReplicaEBC(owner, _bag_features(name, module))
    if isinstance(module, EmbeddingCollection):
        features = [
            (f, f"{name}.{c.name}", c.embedding_dim, PoolingType.NONE)
            for c in module.embedding_configs()
            for f in c.feature_names
        ]
        return _ReplicaEC(owner, features)
    return None


class ServingModel:
    """A model whose embedding lookups go to a replica and whose dense state is the replica's.

    Args:
        replica: the replica serving the run.
        model: an unsharded instance of the trained model (same class and configuration).
        device: where the dense layers run (default: the replica's device).

    Attributes:
        tables: table id of every replaced embedding table.
    """

    def __init__(self, replica: Replica, model: nn.Module, device: str | None = None) -> None:
        self.replica = replica
        self.model = model
        self.device = torch.device(device) if device is not None else replica.device
        self._replaced: list[str] = []
        self.tables: list[str] = []
        for name, module in list(model.named_modules()):
            if not name or any(name.startswith(p + ".") for p in self._replaced):
                continue
            new = _replacement(self, name, module)
            if new is None:
                continue
            parent_name, _, attr = name.rpartition(".")
            setattr(model.get_submodule(parent_name) if parent_name else model, attr, new)
            self._replaced.append(name)
            self.tables += [t for _, t, _, _ in new.features]
        self.model.to(self.device).eval()
        self._snap: Snapshot | None = None
        self._dense_loaded: object | None = None
        self._lock = threading.Lock()

    @property
    def snapshot(self) -> Snapshot:
        """The snapshot of the :meth:`score` call running."""
        if self._snap is None:
            raise NotReadyError("ServingModel lookups run only inside score()")
        return self._snap

    def score(self, *inputs: Any, **kwargs: Any) -> Any:
        """The model's output on ``inputs`` from one snapshot of the replica (no gradient).

        Raises:
            NotReadyError: the replica serves nothing yet.
            ReplicaError: the snapshot has no dense state, or it does not fit the model.
        """
        return self.score_at(*inputs, **kwargs)[1]

    def score_at(self, *inputs: Any, **kwargs: Any) -> tuple[Position, Any]:
        """``(the snapshot's point, the model's output)``: :meth:`score` and where it read."""
        with self._lock, self.replica.pinned() as snap:
            self._load_dense(snap)
            self._snap = snap
            try:
                with torch.no_grad():
                    return snap.position, self.model(*inputs, **kwargs)
            finally:
                self._snap = None

    def _load_dense(self, snap: Snapshot) -> None:
        dense = snap.dense
        if dense is None:
            raise ReplicaError(
                f"{snap.position.describe()} carries no dense state: train with "
                "--dense-every N (the pipeline's dense_every, DELTAREC_DENSE_EVERY) to commit it "
                "with the dumps"
            )
        if self._dense_loaded is dense:
            return
        result = self.model.load_state_dict(dense.tensors, strict=False)
        missing = [k for k in result.missing_keys if not self._is_replaced(k)]
        if missing or result.unexpected_keys:
            raise ReplicaError(
                f"the dense state of {snap.position.describe()} does not fit the model: "
                f"missing {missing[:5]}, unexpected {list(result.unexpected_keys)[:5]}"
            )
        self._dense_loaded = dense

    def _is_replaced(self, key: str) -> bool:
        return any(key.startswith(p + ".") for p in self._replaced)


__all__ = ["ServingModel"]
