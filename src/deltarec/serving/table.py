"""One table of a replica in memory: rows as stored, in torch tensors on CPU or GPU.

A :class:`TableState` is immutable: sorted keys, the slot of each key's row in a row storage
tensor, each key's version. A :class:`TableWriter` makes the next state from a dump's rows
**copy-on-write**: changed rows go to free slots (never to a slot the current state reads),
the key index is rebuilt beside the old one, and the slots the old state used are only
reused once no reader holds a state that reads them (:meth:`TableWriter.reclaim`). So a
lookup that holds a state sees exactly that state's rows while the next dump is applied.

Rows stay encoded as the artifacts store them (float32, float16, or int8_rowwise codes with
their fp16 scale and bias); :func:`decode_rows` turns them into float32 on the device.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from deltarec.artifacts import codec
from deltarec.artifacts.types import FALLBACK_KEY, DType, Op, TableKind, TableSpec
from deltarec.errors import BadInputError

_TORCH_ELEMENT = {
    DType.FLOAT32: torch.float32,
    DType.FLOAT16: torch.float16,
    DType.INT8_ROWWISE: torch.uint8,
}


HOST_LOOKUP_MAX = 256
"""Batches up to this many ids on a CPU table are looked up with numpy (cheaper per call);
larger ones with torch (multi-threaded gathers)."""


@dataclass(frozen=True)
class TableState:
    """One table at one point (never changed once built).

    Attributes:
        table: table id.
        spec: dim, dtype, kind.
        keys: int64 ``[n]`` sorted keys on the device (the lookup index).
        slots: int64 ``[n]`` row slot of each key on the device.
        storage: ``[capacity, encoded_width]`` encoded rows on the device (shared with the
            states before and after this one; only this state's slots are read).
        keys_np, slots_np, versions_np: the same index on the host, and each key's version.
        fallback_slot: slot of key ``-1`` (a ZCH table's miss row), -1 if not held.
        storage_np: ``storage`` as a numpy view when it is on the CPU (None on a GPU): CPU
            lookups of up to :data:`HOST_LOOKUP_MAX` ids index it with numpy, about three
            times cheaper per call than torch's ops.
    """

    table: str
    spec: TableSpec
    keys: torch.Tensor
    slots: torch.Tensor
    storage: torch.Tensor
    keys_np: np.ndarray
    slots_np: np.ndarray
    versions_np: np.ndarray
    fallback_slot: int
    storage_np: np.ndarray | None = None

    def __len__(self) -> int:
        return int(self.keys_np.shape[0])

    @property
    def device(self) -> torch.device:
        """Where the rows are."""
        return self.storage.device

    def lookup(self, ids: torch.Tensor, fallback: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
        """Encoded rows of ``ids`` (int64 ``[n]``, any device): ``(rows [n, width], found [n])``.

        An id the table does not hold reads the fallback row (key ``-1``) of a ZCH table when
        ``fallback`` and the table holds one (SPEC §4 serving semantics), zeros otherwise.
        """
        small = ids.shape[0] <= HOST_LOOKUP_MAX
        if self.storage_np is not None and small and ids.device.type == "cpu":
            return self._lookup_host(ids.numpy().astype(np.int64, copy=False), fallback)
        ids = ids.to(self.storage.device, torch.int64, non_blocking=True)
        n = int(ids.shape[0])
        if len(self) == 0:
            rows = torch.zeros((n, self.storage.shape[1]), dtype=self.storage.dtype)
            return rows.to(self.storage.device), torch.zeros(n, dtype=torch.bool, device=ids.device)
        pos = torch.searchsorted(self.keys, ids).clamp_(max=len(self) - 1)
        found = self.keys[pos] == ids
        slot = self.slots[pos]
        miss = ~found
        use_fallback = fallback and self.fallback_slot >= 0
        if use_fallback:
            slot = torch.where(found, slot, torch.full_like(slot, self.fallback_slot))
        rows = self.storage.index_select(0, slot)
        if not use_fallback:
            rows[miss] = 0
        return rows, found

    def _lookup_host(self, ids: np.ndarray, fallback: bool) -> tuple[torch.Tensor, torch.Tensor]:
        assert self.storage_np is not None
        if len(self) == 0:
            rows = np.zeros((len(ids), self.storage_np.shape[1]), self.storage_np.dtype)
            return torch.from_numpy(rows), torch.zeros(len(ids), dtype=torch.bool)
        pos = np.minimum(np.searchsorted(self.keys_np, ids), len(self) - 1)
        found = self.keys_np[pos] == ids
        slot = self.slots_np[pos]
        use_fallback = fallback and self.fallback_slot >= 0
        if use_fallback:
            slot = np.where(found, slot, self.fallback_slot)
        rows = self.storage_np[slot]
        if not use_fallback and not found.all():
            rows[~found] = 0
        return torch.from_numpy(rows), torch.from_numpy(found)

    def read(self, keys: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Exact readback on the host: ``(found [n], versions [n], rows [n, width])``.

        No fallback: a key the table does not hold is not found, with version 0 and zeros
        (what :meth:`deltarec.stores.Store.read` returns).
        """
        keys = np.asarray(keys, dtype=np.int64)
        width = codec.encoded_width(self.spec.dtype, self.spec.dim)
        element = codec.element_type(self.spec.dtype)
        if len(self) == 0 or len(keys) == 0:
            return (
                np.zeros(len(keys), bool),
                np.zeros(len(keys), np.int64),
                np.zeros((len(keys), width), element),
            )
        pos = np.minimum(np.searchsorted(self.keys_np, keys), len(self) - 1)
        found = self.keys_np[pos] == keys
        versions = np.where(found, self.versions_np[pos], 0).astype(np.int64)
        slots = torch.from_numpy(self.slots_np[pos][found])
        rows = np.zeros((len(keys), width), element)
        if len(slots):
            got = self.storage.index_select(0, slots.to(self.storage.device)).cpu().numpy()
            rows[found] = got.view(element).reshape(-1, width)
        return found, versions, rows


def decode_rows(rows: torch.Tensor, spec: TableSpec) -> torch.Tensor:
    """Encoded rows ``[n, encoded_width]`` -> float32 ``[n, dim]`` on the same device."""
    if spec.dtype is DType.INT8_ROWWISE:
        dim = spec.dim
        tail = rows[:, dim:].contiguous()
        scale = tail[:, 0:2].view(torch.float16).float()
        bias = tail[:, 2:4].view(torch.float16).float()
        return rows[:, :dim].float() * scale + bias
    return rows.float()


def _torch_rows(rows: np.ndarray, spec: TableSpec, device: torch.device) -> torch.Tensor:
    element = codec.element_type(spec.dtype)
    host = np.ascontiguousarray(rows, dtype=element)
    return torch.from_numpy(host).to(device)


@dataclass(frozen=True)
class Staged:
    """A table's next state and the writer's bookkeeping after it, until committed."""

    state: TableState
    free: np.ndarray
    high: int
    retired: tuple[int, np.ndarray]


@dataclass
class _Update:
    """One table's rows of one dump, sorted by key."""

    keys: np.ndarray
    rows: np.ndarray
    ops: np.ndarray
    version: int


class TableWriter:
    """Makes the successive :class:`TableState` of one table (one writer thread).

    Args:
        table: table id.
        spec: the table's dim, dtype and kind.
        device: where the rows live.
        state: the state to continue from (None: an empty table).
    """

    def __init__(
        self,
        table: str,
        spec: TableSpec,
        device: torch.device,
        state: TableState | None = None,
    ) -> None:
        self.table = table
        self.spec = spec
        self.device = device
        self.width = codec.encoded_width(spec.dtype, spec.dim)
        if state is None:
            state = self._build(
                np.empty(0, np.int64),
                np.empty(0, np.int64),
                np.empty(0, np.int64),
                torch.empty((0, self.width), dtype=_TORCH_ELEMENT[spec.dtype], device=device),
            )
        self.state = state
        used = np.zeros(state.storage.shape[0], bool)
        used[state.slots_np] = True
        self._free = np.nonzero(~used)[0].astype(np.int64)
        self._high = int(state.storage.shape[0])
        self._retired: list[tuple[int, np.ndarray]] = []

    @classmethod
    def from_rows(
        cls,
        table: str,
        spec: TableSpec,
        device: torch.device,
        keys: np.ndarray,
        rows: np.ndarray,
        versions: np.ndarray,
    ) -> TableWriter:
        """A table holding ``keys`` (unique) with their encoded ``rows`` and ``versions``."""
        order = np.argsort(keys, kind="stable")
        keys = np.asarray(keys, np.int64)[order]
        _check_unique(table, keys)
        storage = _torch_rows(np.asarray(rows)[order], spec, device)
        slots = np.arange(len(keys), dtype=np.int64)
        writer = cls(table, spec, device)
        writer.state = writer._build(keys, slots, np.asarray(versions, np.int64)[order], storage)
        writer._free = np.empty(0, np.int64)
        writer._high = len(keys)
        return writer

    def _build(
        self, keys: np.ndarray, slots: np.ndarray, versions: np.ndarray, storage: torch.Tensor
    ) -> TableState:
        fallback = -1
        if self.spec.kind is TableKind.ZCH and len(keys):
            i = int(np.searchsorted(keys, FALLBACK_KEY))
            if i < len(keys) and keys[i] == FALLBACK_KEY:
                fallback = int(slots[i])
        return TableState(
            table=self.table,
            spec=self.spec,
            keys=torch.from_numpy(keys).to(self.device),
            slots=torch.from_numpy(slots).to(self.device),
            storage=storage,
            keys_np=keys,
            slots_np=slots,
            versions_np=versions,
            fallback_slot=fallback,
            storage_np=storage.numpy() if storage.device.type == "cpu" else None,
        )

    def stage(
        self,
        keys: np.ndarray,
        rows: np.ndarray,
        ops: np.ndarray,
        version: int,
        epoch: int,
        replace: bool = False,
    ) -> Staged:
        """The next state: the current one with one dump's rows applied (not yet published).

        Upserts (``op = 0``) take their row at ``version``; deletes (``op = 1``) remove the
        key. With ``replace`` (a snapshot dump) every key the dump lacks is removed too.
        Changed rows are written into slots no published state reads; nothing of the writer
        changes until :meth:`commit` (an uncommitted stage is simply dropped). The slots the
        current state used for changed keys are retired at ``epoch``.

        Raises:
            BadInputError: a key appears twice in the dump, or the rows have another width.
        """
        up = self._update(keys, rows, ops, version)
        old = self.state
        if replace:
            retire = old.slots_np
            kept = np.zeros(len(old), bool)
        else:
            pos = np.minimum(np.searchsorted(old.keys_np, up.keys), max(len(old) - 1, 0))
            hit = (old.keys_np[pos] == up.keys) if len(old) else np.zeros(len(up.keys), bool)
            kept = np.ones(len(old), bool)
            kept[pos[hit]] = False
            retire = old.slots_np[pos[hit]]
        upsert = up.ops == Op.UPSERT
        new_keys = up.keys[upsert]
        free, high = self._free, self._high
        take = min(len(new_keys), len(free))
        grown = np.arange(high, high + len(new_keys) - take, dtype=np.int64)
        new_slots = np.concatenate([free[:take], grown])
        free, high = free[take:], high + len(grown)
        storage = old.storage
        if high > storage.shape[0]:  # new memory: states reading the old tensor keep it
            capacity = max(high, int(storage.shape[0] * 1.5) + 1024)
            bigger = torch.empty((capacity, self.width), dtype=storage.dtype, device=self.device)
            bigger[: storage.shape[0]] = storage
            storage = bigger
            free = np.concatenate([free, np.arange(high, capacity, dtype=np.int64)])
            high = capacity
        if len(new_keys):
            storage.index_copy_(
                0,
                torch.from_numpy(new_slots).to(self.device),
                _torch_rows(up.rows[upsert], self.spec, self.device),
            )
        k_keys, k_slots, k_vers = old.keys_np[kept], old.slots_np[kept], old.versions_np[kept]
        at = np.searchsorted(k_keys, new_keys) + np.arange(len(new_keys))
        total = len(k_keys) + len(new_keys)
        into = np.ones(total, bool)
        into[at] = False
        m_keys, m_slots, m_vers = (np.empty(total, np.int64) for _ in range(3))
        m_keys[at], m_slots[at], m_vers[at] = new_keys, new_slots, version
        m_keys[into], m_slots[into], m_vers[into] = k_keys, k_slots, k_vers
        state = self._build(m_keys, m_slots, m_vers, storage)
        return Staged(state, free, high, (epoch, np.asarray(retire, np.int64)))

    def commit(self, staged: Staged) -> None:
        """The staged state is the table's current state now (it was published)."""
        self.state = staged.state
        self._free, self._high = staged.free, staged.high
        if len(staged.retired[1]):
            self._retired.append(staged.retired)

    def reclaim(self, oldest_pinned: int | None) -> None:
        """Free the slots retired at an epoch no pinned reader can still read.

        Args:
            oldest_pinned: the oldest epoch a reader holds (None: no reader holds any).
        """
        keep: list[tuple[int, np.ndarray]] = []
        freed = [self._free]
        for epoch, slots in self._retired:
            if oldest_pinned is None or oldest_pinned >= epoch:
                freed.append(slots)
            else:
                keep.append((epoch, slots))
        self._retired = keep
        self._free = np.concatenate(freed)

    def _update(self, keys: np.ndarray, rows: np.ndarray, ops: np.ndarray, version: int) -> _Update:
        keys = np.asarray(keys, np.int64)
        rows = np.asarray(rows)
        if rows.ndim != 2 or rows.shape[1] != self.width or rows.shape[0] != len(keys):
            raise BadInputError(
                f"table {self.table!r}: rows of shape {rows.shape} for {len(keys)} keys, "
                f"expected [{len(keys)}, {self.width}] ({self.spec.dtype.value} dim "
                f"{self.spec.dim})"
            )
        order = np.argsort(keys, kind="stable")
        keys = keys[order]
        _check_unique(self.table, keys)
        return _Update(keys, rows[order], np.asarray(ops, np.int8)[order], version)


def _check_unique(table: str, keys: np.ndarray) -> None:
    """``keys`` (sorted) must not repeat (SPEC §3: one row per key per table per dump)."""
    if len(keys) > 1:
        dup = keys[1:][keys[1:] == keys[:-1]]
        if len(dup):
            raise BadInputError(
                f"table {table!r}: keys {np.unique(dup)[:5].tolist()} appear more than once "
                "in one dump (at most one row per key per table per dump)"
            )


__all__ = ["Staged", "TableState", "TableWriter", "decode_rows"]
