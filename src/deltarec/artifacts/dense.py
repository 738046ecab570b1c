"""Dense state committed with a dump: the model's non-embedding parameters, one generation.

A dump may carry the training program's dense state (every parameter and buffer outside the
embedding tables) read at the dump's last step, so that dense and sparse move as one point:
promote, rollback and a serving replica take both from the same ``(generation, seq)``.

Layout (an addition to SPEC §3, docs/architecture.md)::

    <root>/<run>/gen-<G>/dump-<S>/dense/state.bin       # written before MANIFEST.json

and the optional MANIFEST.json field::

    "dense": {"path": "dense/state.bin", "sha256": "<hex>", "bytes": 12345, "step": 150,
              "format": "torch"}

``path`` is relative to the dump directory; ``step`` is the training step the state was read
at (the dump's ``last_step``); ``format`` says how the bytes decode (``torch``: a
``torch.save`` of a ``{name: tensor}`` mapping, read with ``weights_only=True``). Readers that
do not know the field ignore it; a dump without it carries no dense state (the latest earlier
dump that has one holds the dense state of the point).

This module never imports torch: the bytes are made by the training side and decoded by the
serving side. :class:`DenseCapture` hands a captured state from the training thread to the
commit, and :class:`DenseCommitRoot` writes it into the dump just before its manifest, so the
manifest names the state only once it is durable.
"""

from __future__ import annotations

import dataclasses
import hashlib
import posixpath
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from deltarec.artifacts.root import ArtifactRoot
from deltarec.artifacts.types import Manifest
from deltarec.errors import ArtifactError, ChecksumError

DENSE_FIELD = "dense"
"""The MANIFEST.json field naming a dump's dense state."""
DENSE_PATH = "dense/state.bin"
"""Where a dump's dense state lies, relative to its dump directory."""
TORCH_FORMAT = "torch"
"""``torch.save`` of a ``{name: tensor}`` mapping (``torch.load(..., weights_only=True)``)."""

DensePayload = Callable[[], bytes]
"""Makes the bytes of a captured dense state (called on the committing thread)."""


@dataclass(frozen=True)
class DenseInfo:
    """The ``dense`` field of a manifest.

    Attributes:
        path: the file, relative to the dump directory.
        sha256: hex digest of its bytes.
        bytes: its size.
        step: the training step the state was read at.
        format: how the bytes decode (:data:`TORCH_FORMAT`).
    """

    path: str
    sha256: str
    bytes: int
    step: int
    format: str = TORCH_FORMAT

    def to_json(self) -> dict[str, Any]:
        """The JSON object of the manifest field."""
        return dataclasses.asdict(self)

    @classmethod
    def from_json(cls, obj: Any, where: str) -> DenseInfo:
        """Parse the manifest field; raises :class:`ArtifactError` naming ``where``."""
        try:
            info = cls(
                path=str(obj["path"]),
                sha256=str(obj["sha256"]),
                bytes=int(obj["bytes"]),
                step=int(obj["step"]),
                format=str(obj.get("format", TORCH_FORMAT)),
            )
        except (KeyError, TypeError, ValueError, AttributeError) as e:
            raise ArtifactError(where, f"malformed {DENSE_FIELD!r} field {obj!r}: {e}") from e
        if info.path.startswith("/") or ".." in info.path.split("/"):
            raise ArtifactError(where, f"dense path {info.path!r} leaves the dump directory")
        return info


def dense_of(manifest: Manifest) -> DenseInfo | None:
    """The dense state a manifest names, or None (the field is optional)."""
    obj = manifest.extra.get(DENSE_FIELD)
    if obj is None:
        return None
    where = f"run {manifest.run!r} generation {manifest.generation} dump {manifest.seq}"
    return DenseInfo.from_json(obj, f"MANIFEST.json of {where}")


def write_dense(
    root: ArtifactRoot, run: str, generation: int, seq: int, data: bytes, step: int
) -> DenseInfo:
    """Write a dump's dense state durably (temporary file, fsync, rename); describe it.

    Call before the dump's manifest is committed; writing again replaces the file.
    """
    path = posixpath.join(root.dump_dir(run, generation, seq), DENSE_PATH)
    root.write_bytes_atomic(path, data)
    return DenseInfo(DENSE_PATH, hashlib.sha256(data).hexdigest(), len(data), step)


def read_dense(root: ArtifactRoot, manifest: Manifest) -> tuple[DenseInfo, bytes] | None:
    """The dense state of a committed dump and its bytes, checked; None if it has none.

    Raises:
        ArtifactError: the file the manifest names is missing.
        ChecksumError: its sha256 or size differs from the manifest's.
    """
    info = dense_of(manifest)
    if info is None:
        return None
    dump_dir = root.dump_dir(manifest.run, manifest.generation, manifest.seq)
    path = posixpath.join(dump_dir, info.path)
    try:
        with root.open_listed(dump_dir, info.path) as f:
            if isinstance(f, str):
                with open(f, "rb") as local:
                    data = local.read()
            else:
                data = f.read()
    except FileNotFoundError:
        raise ArtifactError(
            root.url(path), "dense state listed in the manifest is missing"
        ) from None
    digest = hashlib.sha256(data).hexdigest()
    if digest != info.sha256 or len(data) != info.bytes:
        raise ChecksumError(
            root.url(path),
            f"content does not match the manifest's sha256 {info.sha256} ({info.bytes} bytes)",
        )
    return info, data


class DenseCapture:
    """Dense states captured on the training thread, handed to the dump commit by step.

    The training side calls :meth:`settle` once per step, after the dumper had its chance to
    dump at that step, with a payload if it captured the dense state then. The commit of a
    dump whose last step is ``N`` (:meth:`take`) waits until step ``N`` is settled, so it never
    misses a state captured a moment after the dump was queued. :meth:`close` releases every
    waiter (training ended or failed).

    Args:
        timeout_s: how long a commit waits for its step to be settled.
    """

    def __init__(self, timeout_s: float = 600.0) -> None:
        self.timeout_s = timeout_s
        self._cond = threading.Condition()
        self._settled = -1
        self._closed = False
        self._pending: dict[int, DensePayload] = {}

    def settle(self, step: int, payload: DensePayload | None = None) -> None:
        """Step ``step`` is done on the training side; ``payload``: its captured state."""
        with self._cond:
            if payload is not None:
                self._pending[step] = payload
            self._settled = max(self._settled, step)
            self._cond.notify_all()

    def close(self) -> None:
        """No more steps will be settled; waiting commits go on without a state."""
        with self._cond:
            self._closed = True
            self._cond.notify_all()

    def take(self, step: int) -> DensePayload | None:
        """The payload captured at ``step`` (None if none), once ``step`` is settled.

        Payloads of earlier steps are dropped (their dumps are committed). Two dumps at one
        step (a delta and the final dump) both get the step's payload.

        Raises:
            ArtifactError: ``step`` was not settled within ``timeout_s``.
        """
        with self._cond:
            done = self._cond.wait_for(
                lambda: self._closed or self._settled >= step, timeout=self.timeout_s
            )
            if not done:
                raise ArtifactError(
                    f"dense state of step {step}",
                    f"the training thread did not settle step {step} within {self.timeout_s} s",
                )
            for old in [s for s in self._pending if s < step]:
                del self._pending[old]
            return self._pending.get(step)


class DenseCommitRoot(ArtifactRoot):
    """An artifact root whose manifest commits carry the dense state captured at their step.

    Everything else is :class:`ArtifactRoot`. :meth:`commit_manifest` writes the captured
    state into the dump (durable) first and adds the ``dense`` field to the manifest it
    commits; a dump without a captured state is committed unchanged.

    Args:
        uri: the artifact root.
        storage_options: passed to fsspec.
        capture: where the training side leaves captured states.
    """

    def __init__(
        self, uri: str, storage_options: dict[str, Any] | None, capture: DenseCapture
    ) -> None:
        super().__init__(uri, storage_options)
        self.capture = capture

    def commit_manifest(self, manifest: Manifest) -> str:
        """Write the dense state of the dump's last step (if captured), then the manifest."""
        payload = self.capture.take(manifest.last_step)
        if payload is not None:
            info = write_dense(
                self, manifest.run, manifest.generation, manifest.seq, payload(), manifest.last_step
            )
            extra = {**manifest.extra, DENSE_FIELD: info.to_json()}
            manifest = dataclasses.replace(manifest, extra=extra)
        return super().commit_manifest(manifest)


__all__ = [
    "DENSE_FIELD",
    "DENSE_PATH",
    "TORCH_FORMAT",
    "DenseCapture",
    "DenseCommitRoot",
    "DenseInfo",
    "DensePayload",
    "dense_of",
    "read_dense",
    "write_dense",
]
