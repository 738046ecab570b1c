"""A run's history read once per command (the architecture review's second step).

A command walks a run's history many times: verify resolves the lineage, the dumps, their
manifests and bases for the expected state, then again for checksums, rollback generations
and later deletes; on ``s3://`` every listing, existence check and JSON read is a request.
:class:`RunHistory` is the artifact root as one command sees it: every folder listing,
existence check and JSON record is read from the root once and then answered from memory, so
``verify``, ``promote``, ``rollback``, ``publish``, ``compact`` and ``inspect`` pay each
request once however often their parts ask. Shards and base parts are still read as needed.

It is for one command's lifetime: what the command itself writes through it (a generation, a
manifest, a record) makes it read again; what others write meanwhile it does not see. A long
runner (the serving replica, the trainer) uses the plain :class:`ArtifactRoot`.
"""

from __future__ import annotations

from typing import Any

from deltarec.artifacts.root import ArtifactRoot
from deltarec.artifacts.types import GenerationInfo, Manifest

_MISSING = object()


class RunHistory(ArtifactRoot):
    """An :class:`ArtifactRoot` whose listings, existence checks and JSON reads are read once.

    Args:
        root: the artifact root (its filesystem is shared, nothing is copied).

    Attributes:
        reads: listings, existence checks and JSON reads that went to the root (the rest were
            answered from memory): a command's requests on an object store.
    """

    def __init__(self, root: ArtifactRoot) -> None:
        self.__dict__.update(root.__dict__)
        self._memo: dict[tuple[str, str], Any] = {}
        self.reads = 0

    @classmethod
    def of(cls, root: ArtifactRoot) -> RunHistory:
        """``root`` itself if it is a history already, else a history of it."""
        return root if isinstance(root, RunHistory) else cls(root)

    def forget(self) -> None:
        """Read everything again from now on (after writes made outside this object)."""
        self._memo.clear()

    def _once(self, kind: str, path: str, read: Any) -> Any:
        key = (kind, path)
        found = self._memo.get(key, _MISSING)
        if found is _MISSING:
            self.reads += 1
            try:
                found = read()
            except FileNotFoundError as e:
                found = e
            self._memo[key] = found
        if isinstance(found, FileNotFoundError):
            raise found
        return found

    # ---- reads, once ---------------------------------------------------------------------
    def _names(self, path: str) -> list[str]:
        return list(self._once("names", path, lambda: ArtifactRoot._names(self, path)))

    def exists(self, path: str) -> bool:
        """Whether ``path`` exists (asked of the root once)."""
        return bool(self._once("exists", path, lambda: ArtifactRoot.exists(self, path)))

    def read_json(self, path: str) -> dict[str, Any]:
        """Read and parse a JSON file once (the same object each time: callers only read it)."""
        return dict(self._once("json", path, lambda: ArtifactRoot.read_json(self, path)))

    def read_generation(self, run: str, generation: int) -> GenerationInfo:
        """GENERATION.json of one generation, parsed once."""
        path = self.generation_file(run, generation)
        return self._parsed(path, lambda: ArtifactRoot.read_generation(self, run, generation))

    def read_manifest(self, run: str, generation: int, seq: int) -> Manifest:
        """MANIFEST.json of one dump, parsed once (a manifest of 5,120 shards takes ~10 ms)."""
        path = self.manifest_file(run, generation, seq)
        return self._parsed(path, lambda: ArtifactRoot.read_manifest(self, run, generation, seq))

    def _parsed(self, path: str, parse: Any) -> Any:
        key = ("parsed", path)
        if key not in self._memo:
            self._memo[key] = parse()  # errors are raised, not kept: they end the command
        return self._memo[key]

    # ---- writes make it read again ---------------------------------------------------------
    def write_bytes_atomic(self, final: str, data: bytes) -> None:
        """As :meth:`ArtifactRoot.write_bytes_atomic`, then forget what was read."""
        ArtifactRoot.write_bytes_atomic(self, final, data)
        self.forget()

    def replace_bytes(self, path: str, data: bytes) -> None:
        """As :meth:`ArtifactRoot.replace_bytes`, then forget what was read."""
        ArtifactRoot.replace_bytes(self, path, data)
        self.forget()

    def create_exclusive(self, path: str, data: bytes) -> bool:
        """As :meth:`ArtifactRoot.create_exclusive`, then forget what was read."""
        created = ArtifactRoot.create_exclusive(self, path, data)
        self.forget()
        return created

    def publish_file(self, tmp: str, final: str) -> None:
        """As :meth:`ArtifactRoot.publish_file`, then forget what was read."""
        ArtifactRoot.publish_file(self, tmp, final)
        self.forget()
