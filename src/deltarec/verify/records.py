"""Verification records: the proof ``promote`` asks for (one small JSON file per check).

A verification run from the CLI leaves a record in the artifact root, next to the generation it
verified::

    <root>/<run>/gen-<G:06d>/verifications/dump-<S:06d>.<store id>.json

``<store id>`` is the first 16 hex digits of the sha256 of the store's identity
(:meth:`Store.identity`: where its rows are, resolved - the absolute path of a SQLite file;
the server, database and schema or key prefix of PostgreSQL and Redis - and the random id the
store keeps in its registry), never of the URL as typed: a record made for one store never
opens another store's gate, be it a copy elsewhere, a file of the same relative name in another
directory, or a store made anew at the same place. No credential reaches the artifact root.
The file holds the verification's JSON document (:func:`deltarec.verify.output.to_json`, whose
``store_id`` is that id) plus ``recorded_at``. The newest verification of a (generation, dump,
store) replaces the earlier record: a later failed check revokes an earlier pass.

The records live in the artifact root rather than in the store's registry because they are
about artifacts *and* a store, the store's registry interface has no place for them, and any
tool that can read the artifacts can audit them.
"""

from __future__ import annotations

import hashlib
import json
import posixpath
from dataclasses import dataclass
from typing import Any

from deltarec.artifacts.root import ArtifactRoot, dump_name
from deltarec.artifacts.types import parse_time, utc_now
from deltarec.errors import ArtifactError, BadInputError
from deltarec.stores.base import Store
from deltarec.verify.output import to_json
from deltarec.verify.types import VerifyResult

RECORDS_DIR = "verifications"


def store_id(store: Store) -> str:
    """A stable, credential-free id of a store: sha256 of :meth:`Store.identity`, 16 hex digits."""
    return hashlib.sha256(store.identity().encode()).hexdigest()[:16]


def record_path(root: ArtifactRoot, run: str, generation: int, seq: int, store_id: str) -> str:
    """Where the record of verifying ``generation`` through dump ``seq`` lies (:func:`store_id`)."""
    name = f"{dump_name(seq)}.{store_id}.json"
    return posixpath.join(root.gen_dir(run, generation), RECORDS_DIR, name)


@dataclass(frozen=True)
class VerificationRecord:
    """A verification as recorded: enough for promote to decide, and the full document."""

    run: str
    generation: int
    through_seq: int
    store: str
    passed: bool
    failure: str
    recorded_at: str
    path: str
    document: dict[str, Any]

    @property
    def recorded_unix(self) -> float:
        """``recorded_at`` in unix seconds."""
        return parse_time(self.recorded_at)


def write_record(root: ArtifactRoot, result: VerifyResult) -> str | None:
    """Record ``result`` (atomically, replacing an earlier record). Returns the path written.

    Nothing is recorded for a generation without a committed dump (``through_seq`` None).

    Raises:
        BadInputError: the result names no store id (it was not made by
            :func:`deltarec.verify.verify` against an open store).
        ArtifactError: the record cannot be written (a read-only artifact root), naming where.
    """
    if result.through_seq is None:
        return None
    if not result.store_id:
        raise BadInputError(
            f"the verification of run {result.run!r} generation {result.generation} against "
            f"{result.store} has no store id: it cannot be recorded for promote"
        )
    doc = to_json(result)
    doc["recorded_at"] = utc_now()
    path = record_path(root, result.run, result.generation, result.through_seq, result.store_id)
    try:
        root.write_bytes_atomic(path, json.dumps(doc, indent=2, allow_nan=False).encode())
    except OSError as e:
        why = e.strerror or str(e)
        raise ArtifactError(root.url(path), f"cannot write the verification record: {why}") from e
    return path


def read_record(
    root: ArtifactRoot, run: str, generation: int, seq: int, store: Store | str
) -> VerificationRecord | None:
    """The record of verifying ``generation`` through ``seq`` against ``store``, None if none.

    ``store``: the open store, or its :func:`store_id`.

    Raises:
        ArtifactError: the record exists but is malformed, or was made for another store.
    """
    sid = store if isinstance(store, str) else store_id(store)
    path = record_path(root, run, generation, seq, sid)
    if not root.exists(path):
        return None
    doc = root.read_json(path)
    if doc.get("store_id") != sid:
        raise ArtifactError(
            root.url(path), f"verification record of store id {doc.get('store_id')!r}, not {sid!r}"
        )
    try:
        return VerificationRecord(
            run=str(doc["run"]),
            generation=int(doc["generation"]),
            through_seq=int(doc["through_seq"]),
            store=str(doc["store"]),
            passed=bool(doc["passed"]),
            failure=str(doc.get("failure", "")),
            recorded_at=str(doc["recorded_at"]),
            path=root.url(path),
            document=doc,
        )
    except (KeyError, TypeError, ValueError) as e:
        raise ArtifactError(root.url(path), f"malformed verification record: {e}") from e
