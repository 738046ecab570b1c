"""Deltarec's own record of a sharded module's lookups, for tables torchrec cannot attribute.

torchrec's ``ModelDeltaTracker`` (1.8) maps tables to paths by **table name** and lookups to
tables by **feature name**, over the whole model. Three valid models defeat it:

* the same table name in two modules: one module's features are missing from its map, and
  its first lookup fails with ``KeyError`` inside ``record_ids`` (a crash mid-training);
* one feature name feeding tables of two modules: the second module's lookups are filed
  under the first module's table;
* a table and a module (any ``nn.Module``) sharing a name: the table's lookups are filed
  under the module's path (torchrec logs ``Override <table path> with <module path>``).

For such a sharded EmbeddingBagCollection / EmbeddingCollection, :class:`LookupRecorder`
records the lookups itself: a forward pre-hook on each of the module's embedding kernels (the
``_emb_modules`` of its lookups, data-parallel ones included) sees the kernel's input after
the input distribution, i.e. the **local** row ids of this rank's shard, exactly what
torchrec's tracker records. The kernel's config lists its tables in input order, each with its
features, so every id is filed by position under the table it is looked up in: no name is
looked up in a model-wide map. The recorder answers like torchrec's tracker store
(``per_fqn_lookups``), so :class:`~deltarec.tracking.tracker.TrackerHub` drains both alike.

Hooks are installed on the module's kernel instances (never on a class) and removed by
:meth:`LookupRecorder.close`. torchrec's post-lookup hook, which discovery detaches from such a
module, stays detached after ``close``: it could not attribute that module's lookups. A
kernel input the recorder cannot attribute is not raised inside the model's forward; it is
kept and raised by :meth:`LookupRecorder.check` at the next dump.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from typing import Any

import torch
from torch import nn

from deltarec.tracking.errors import TrackingError


def embedding_kernels(module: Any) -> Iterator[Any]:
    """The embedding kernels of a sharded EBC/EC on this rank (``_emb_modules`` of each lookup).

    A data-parallel lookup is wrapped in ``DistributedDataParallel``; its kernels are those of
    the wrapped lookup.
    """
    for lookup in getattr(module, "_lookups", ()):
        inner = getattr(lookup, "module", lookup)
        yield from getattr(inner, "_emb_modules", ())


def kernel_tables(kernel: Any) -> list[tuple[str, list[str]]]:
    """``[(table name, feature names)]`` of one kernel's config, in input order."""
    config = getattr(kernel, "config", None)
    tables = getattr(config, "embedding_tables", None)
    if tables is None:
        raise AttributeError(f"{type(kernel).__name__} has no config.embedding_tables")
    return [(str(t.name), [str(f) for f in t.feature_names]) for t in tables]


class LookupRecorder:
    """Records the local row ids of one sharded module's lookups, filed per table path.

    Args:
        module: a ``ShardedEmbeddingBagCollection`` or ``ShardedEmbeddingCollection``.
        paths: table name -> the path the ids are filed under (the key its source takes).
        table_ids: table name -> table id (for error messages).

    Raises:
        TrackingError: if a kernel's config is not understood or names a table the module
            does not have.
    """

    def __init__(self, module: Any, paths: Mapping[str, str], table_ids: Mapping[str, str]) -> None:
        self.per_fqn_lookups: dict[str, list[torch.Tensor]] = {}
        self.store = self
        self.listeners: list[Callable[[str, torch.Tensor], None]] = []
        """Called with ``(path, ids)`` after each recorded lookup (``TrackerHub.watch``)."""
        self.failure: TrackingError | None = None
        """The first lookup that could not be attributed (raised by :meth:`check`)."""
        self.tables_seen: set[str] = set()
        """Names of the tables this rank's kernels look up (the ones recorded here)."""
        self._handles: list[Any] = []
        self._table_ids = dict(table_ids)
        try:
            for kernel in embedding_kernels(module):
                self._install(kernel, paths)
        except BaseException:
            self.close()
            raise

    def _install(self, kernel: nn.Module, paths: Mapping[str, str]) -> None:
        try:
            tables = kernel_tables(kernel)
        except AttributeError as e:
            raise TrackingError(
                sorted(self._table_ids.values()),
                (),
                f"the embedding kernel {type(kernel).__name__} is not understood ({e}); this "
                "torchrec version's lookup modules are not supported by deltarec's recorder",
            ) from e
        keys: list[str] = []
        where: list[str] = []
        for name, features in tables:
            if name not in paths:
                raise TrackingError(
                    sorted(self._table_ids.values()),
                    (),
                    f"an embedding kernel of the module holds table {name!r}, which the module "
                    "does not list",
                )
            keys += features
            where += [paths[name]] * len(features)
            self.tables_seen.add(name)
        names = tuple(sorted({self._table_ids[n] for n, _ in tables}))

        def record(_kernel: nn.Module, args: tuple[Any, ...]) -> None:
            self._record(args[0], keys, where, names)

        self._handles.append(kernel.register_forward_pre_hook(record))

    def _record(self, features: Any, keys: list[str], where: list[str], names: Any) -> None:
        got = list(features.keys())
        if got != keys:
            # Not raised inside the model's forward: the next dump raises it (see check()).
            if self.failure is None:
                self.failure = TrackingError(
                    list(names),
                    (),
                    f"an embedding kernel received features {got}, its config lists {keys}; "
                    "the lookup's ids cannot be attributed to tables",
                )
            return
        values = features.values().detach()
        at = 0
        for path, n in zip(where, features.length_per_key(), strict=True):
            if n:
                ids = values[at : at + n]
                self.per_fqn_lookups.setdefault(path, []).append(ids)
                for fn in self.listeners:
                    fn(path, ids)
            at += n

    def check(self) -> None:
        """Raise the first lookup that could not be attributed since tracking began."""
        if self.failure is not None:
            raise self.failure

    def close(self) -> None:
        """Remove the hooks (idempotent); what was recorded stays readable."""
        for handle in self._handles:
            handle.remove()
        self._handles = []
