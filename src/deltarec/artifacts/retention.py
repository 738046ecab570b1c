"""Retention (SPEC §3a): which dumps and bases of a run may go, and why each stays.

A dump or base is deleted only when a committed base (its BASE.json read, never a listing
alone) covers it and nothing still needs it:

* every generation's newest dump stays (the chain's end), and so does everything the newest
  point of each generation that no later generation restored from is read from (the newest
  base that fits and the dumps after it);
* a kept promotion (a rollback target) keeps what its point is read from;
* a kept checkpoint ``G@STEP`` keeps what a restore from it reads: the dumps of ``G`` after the
  step and every dump of a later generation (its republish reads them);
* a store whose progress marks are behind keeps the dumps it still needs, unless a base of that
  generation can catch it up (``deltarec publish`` starts a store from a base);
* the dumps of the generation a running trainer holds the lease of that a store lacks (its
  publisher may still read them from the outbox);
* for each generation, the base that covers most of it, so its chain stays whole.

An incomplete base (no BASE.json) is deleted once a committed base of its generation through a
later dump supersedes it; any other may be being written, and stays.

Deletion removes MANIFEST.json (BASE.json) first, then the directory: a deletion cut short
leaves an incomplete dump (base) that readers ignore, and a base still covers it.
"""

from __future__ import annotations

import contextlib
import posixpath
import time
from dataclasses import dataclass, field

from deltarec.artifacts.base import BaseInfo, base_name, list_bases, read_base, usable_base
from deltarec.artifacts.lease import current_holder
from deltarec.artifacts.lineage import cutoffs
from deltarec.artifacts.root import ArtifactRoot, dump_name, gen_name
from deltarec.artifacts.types import GenerationInfo
from deltarec.faults import failpoint


@dataclass(frozen=True)
class Decision:
    """One dump or base: kept or deleted, and why."""

    path: str
    kind: str  # "dump" | "base"
    generation: int
    seq: int
    delete: bool
    reason: str


@dataclass
class Needs:
    """What outside the artifacts still needs them.

    Attributes:
        promotions: ``(generation, seq)`` rollback targets within the kept promotions.
        checkpoints: ``(generation, step)`` of the checkpoints a restore may come back to.
        stores: store name -> generation -> the newest dump it holds completely (-1: none).
    """

    promotions: list[tuple[int, int]] = field(default_factory=list)
    checkpoints: list[tuple[int, int]] = field(default_factory=list)
    stores: dict[str, dict[int, int]] = field(default_factory=dict)


class _Plan:
    def __init__(self, root: ArtifactRoot, run: str) -> None:
        self.root, self.run = root, run
        self.gens = root.list_generations(run)
        self.seqs = {g: root.committed_seqs(run, g) for g in self.gens}
        self.bases: dict[tuple[int, int], BaseInfo] = {
            b: read_base(root, run, *b) for b in list_bases(root, run)
        }
        self.keep_dumps: dict[tuple[int, int], str] = {}
        self.keep_bases: dict[tuple[int, int], str] = {}

    def info(self, g: int) -> GenerationInfo:
        return self.root.read_generation(self.run, g)

    def keep(self, g: int, s: int, why: str) -> None:
        if s in self.seqs.get(g, ()):
            self.keep_dumps.setdefault((g, s), why)

    def covering(self, g: int) -> tuple[int, int] | None:
        """The base that folds most of generation ``g``."""
        best = max(self.bases, key=lambda b: (self.bases[b].covers(g), b), default=None)
        return best if best is not None and self.bases[best].covers(g) >= 0 else None

    def point(self, g: int, s: int, why: str) -> None:
        """Keep what a reader of ``(g, s)`` reads: the base that fits and the dumps after it."""
        chain = cutoffs(self.root, self.run, g)
        base = usable_base(self.root, self.run, chain, s)
        folded = {e.generation: e.through_seq for e in base.lineage} if base else {}
        if base is not None:
            self.keep_bases.setdefault((base.generation, base.through_seq), why)
        for gen, _ in chain:
            if gen in folded and base is not None and gen != base.generation:
                continue
            for seq in self.seqs.get(gen, ()):
                if seq > folded.get(gen, -1) and (gen != g or seq <= s):
                    self.keep(gen, seq, why)


def plan(root: ArtifactRoot, run: str, needs: Needs, now: float | None = None) -> list[Decision]:
    """Every committed dump and base of ``run``, kept or deleted, with the reason."""
    p = _Plan(root, run)
    parents = {info.parent.generation for info in map(p.info, p.gens) if info.parent}
    for g in p.gens:
        if p.seqs[g]:
            newest = p.seqs[g][-1]
            p.keep(g, newest, f"the newest dump of generation {g} (the chain's end)")
            if g not in parents:  # a generation a later one restored from is read through it
                p.point(g, newest, f"read by every command at generation {g} dump {newest}")
        cover = p.covering(g)
        if cover is not None:
            p.keep_bases.setdefault(cover, f"covers generation {g}'s dumps (its chain)")
    for g, s in needs.promotions:
        p.point(g, s, f"rollback target generation {g} dump {s} (a kept promotion)")
    for g, step in needs.checkpoints:
        _checkpoint(p, g, step)
    for name, held in needs.stores.items():
        _store(p, name, held)
    _lease(p, needs, time.time() if now is None else now)
    return _decisions(p)


def _checkpoint(p: _Plan, g: int, step: int) -> None:
    why = f"a restore from checkpoint generation {g} step {step} reads it"
    before = [s for s in p.seqs.get(g, ()) if p.root.read_manifest(p.run, g, s).last_step <= step]
    if before:
        p.point(g, before[-1], why)
    for s in p.seqs.get(g, ()):
        if s not in before:
            p.keep(g, s, why)
    for later in p.gens:
        if later > g:
            for s in p.seqs[later]:
                p.keep(later, s, why)


def _store(p: _Plan, name: str, held: dict[int, int]) -> None:
    for g, s in held.items():
        seqs = p.seqs.get(g, [])
        if not seqs or s >= seqs[-1]:
            continue
        own = [b for b in p.keep_bases if b[0] == g]
        if own:  # publish starts the store from the generation's base
            continue
        for seq in seqs:
            if seq > s:
                p.keep(g, seq, f"store {name} holds generation {g} only through dump {s}")


def _lease(p: _Plan, needs: Needs, now: float) -> None:
    """A running trainer's publisher may still read its generation's dumps from the outbox."""
    holder = current_holder(p.root, p.run)
    if holder is None or holder.generation is None or not holder.alive(now):
        return
    g = holder.generation
    held = [marks.get(g, -1) for marks in needs.stores.values()]
    published = min(held) if held else -1
    for s in p.seqs.get(g, ()):
        if s > published:
            p.keep(
                g,
                s,
                f"a running trainer writes generation {g} ({holder.describe(now)}) and not "
                "every store holds this dump yet",
            )


def _decisions(p: _Plan) -> list[Decision]:
    out: list[Decision] = []
    run_dir = p.root.run_dir(p.run)
    for g in p.gens:
        cover = p.covering(g)
        folded = p.bases[cover].covers(g) if cover is not None and cover in p.keep_bases else -1
        for s in p.seqs[g]:
            path = p.root.url(f"{run_dir}/{gen_name(g)}/{dump_name(s)}")
            why = p.keep_dumps.get((g, s))
            if why is None and s > folded:
                why = "not covered by a committed base"
            if why is not None:
                out.append(Decision(path, "dump", g, s, False, why))
            else:
                assert cover is not None
                reason = f"covered by {base_name(*cover)}"
                out.append(Decision(path, "dump", g, s, True, reason))
        if cover is not None and folded >= 0:
            name = base_name(*cover)
            for s in p.root.list_incomplete_dumps(p.run, g):
                if s <= folded:  # a deletion cut short: a writer's dump is newer than any base
                    path = p.root.url(f"{run_dir}/{gen_name(g)}/{dump_name(s)}")
                    why = f"incomplete (no MANIFEST.json) and covered by {name}"
                    out.append(Decision(path, "dump", g, s, True, why))
    for b in sorted(p.bases):
        path = p.root.url(p.root.base_dir(p.run, *b))
        why = p.keep_bases.get(b)
        newest = max(p.keep_bases, default=b)
        reason = why or f"superseded by {base_name(*newest)}; no kept point reads it"
        out.append(Decision(path, "base", b[0], b[1], why is None, reason))
    return out + _abandoned_bases(p)


def _abandoned_bases(p: _Plan) -> list[Decision]:
    """Incomplete bases (no BASE.json) of a generation a later committed base of it supersedes.

    A compaction (or a fan-out's partitions) killed and never run again leaves one; a base
    being written is of the newest point, so no committed base of its generation is newer.
    Should one still be written, its commit finds its parts gone and refuses: nothing is lost.
    """
    out = []
    for g, s in p.root.base_dirs(p.run):
        if (g, s) in p.bases:
            continue
        newer = [b for b in p.bases if b[0] == g and b[1] > s]
        if newer:
            path = p.root.url(p.root.base_dir(p.run, g, s))
            why = f"incomplete (no BASE.json) and superseded by {base_name(*max(newer))}"
            out.append(Decision(path, "base", g, s, True, why))
    return out


def apply(root: ArtifactRoot, run: str, decisions: list[Decision]) -> int:
    """Delete what ``decisions`` delete: the commit record first, then the directory.

    Returns:
        The number of dumps and bases deleted.
    """
    done = 0
    for d in decisions:
        if not d.delete:
            continue
        if d.kind == "dump":
            folder = root.dump_dir(run, d.generation, d.seq)
            record = root.manifest_file(run, d.generation, d.seq)
        else:
            folder = root.base_dir(run, d.generation, d.seq)
            record = root.base_file(run, d.generation, d.seq)
        if root.exists(record):
            root.fs.rm(record)
        failpoint("gc.delete")  # crash tests: a commit record gone, its folder not yet
        inner = _subfolders(root, folder)
        if root.exists(folder):
            root.fs.rm(folder, recursive=True)
        for sub in [*inner, folder]:  # deepest first: a store drops only an empty folder
            _drop_folder(root, sub)
        done += 1
    return done


def _subfolders(root: ArtifactRoot, folder: str) -> list[str]:
    """The folders inside ``folder`` on an object store, deepest first (none locally)."""
    if root.is_local or not hasattr(root.fs, "call_s3"):
        return []
    try:
        found = root.fs.find(folder, withdirs=True, detail=True)
    except FileNotFoundError:
        return []
    subs = [str(p) for p, info in found.items() if (info or {}).get("type") == "directory"]
    subs = [p.rstrip("/") for p in subs if p.rstrip("/") != folder.rstrip("/")]
    return sorted(set(subs), key=lambda p: p.count("/"), reverse=True)


def _drop_folder(root: ArtifactRoot, folder: str) -> None:
    """Remove an emptied folder's own entry on an object store.

    SeaweedFS (and stores with directory objects) keep listing a folder once its files are
    gone; every later listing of the generation would then ask for its manifest again, so the
    cost of a run's commands would keep growing with the history gc deleted. Deleting the
    ``<folder>/`` key drops the entry (a no-op where the store keeps none, as AWS S3).
    """
    if root.is_local or not hasattr(root.fs, "call_s3"):
        return
    bucket, _, key = folder.partition("/")
    # the folder's files are gone either way: a failure here only leaves a listed entry
    with contextlib.suppress(OSError, ValueError):
        root.fs.call_s3("delete_object", Bucket=bucket, Key=key.rstrip("/") + "/")
    root.fs.invalidate_cache(posixpath.dirname(folder))
