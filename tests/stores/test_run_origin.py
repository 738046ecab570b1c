"""A run name is one lineage of artifacts: another's generation under it is refused.

The store's progress marks count a generation's dumps by number; artifacts of another lineage
under the same run name and generation (an artifact root made again, a second team's run of
the same name) would have those dumps skipped as published and the rest laid over the first's
rows. The generation's ``created_at`` (GENERATION.json) is registered with it, and a publish of
(or a rollback to) other artifacts is refused, naming both, with the store left as the first
lineage made it; a copy of the same artifacts (the same GENERATION.json) is the same lineage.
"""

from __future__ import annotations

import shutil

import pytest

from deltarec.artifacts import ArtifactRoot
from deltarec.artifacts.types import DumpKind, TableSpec
from deltarec.cli import main
from deltarec.errors import BadInputError
from deltarec.stores import open_store
from deltarec.testing.dumps import new_generation, random_rows, write_dump

T = "sparse.ebc.user_id"
TABLES = {T: TableSpec(dim=8, num_embeddings=1000)}
RUN = "ctr"


def _lineage(path, seed: int) -> ArtifactRoot:
    root = ArtifactRoot(str(path))
    info = new_generation(root, RUN, TABLES, world_size=1)
    rows = {T: {0: random_rows(range(0, 1000, 3), TABLES[T], seed)}}
    write_dump(root, info, 0, rows, kind=DumpKind.SNAPSHOT)
    write_dump(root, info, 1, {T: {0: random_rows(range(0, 60), TABLES[T], seed + 10)}})
    return root


def _cli(command: str, root: ArtifactRoot, url: str, *more: str) -> int:
    return main([command, *more, "--artifacts", root.uri, "--run", RUN, "--store", url])


def test_another_lineage_under_a_published_run_is_refused_and_a_copy_of_the_first_is_not(
    any_backend, tmp_path, capsys
):
    first, other = _lineage(tmp_path / "a", 1), _lineage(tmp_path / "b", 2)
    made = [r.read_generation(RUN, 1).created_at for r in (first, other)]
    assert made[0] != made[1]
    url = any_backend.url
    assert _cli("publish", first, url) == 0
    capsys.readouterr()
    assert _cli("publish", other, url) == 2
    err = capsys.readouterr().err
    assert (
        f"run 'ctr' generation 1 was published here from artifacts created at {made[0]}, "
        f"not from these (created at {made[1]})"
    ) in err, err
    assert "Traceback" not in err
    if any_backend.kind == "featurestore":  # the view is named, then its registry
        assert "featurestore://proj/emb?region=cn-hangzhou (registry sqlite:///" in err, err
    assert _cli("verify", first, url, "--all") == 0  # the store holds the first, untouched
    capsys.readouterr()
    assert _cli("verify", other, url, "--all") == 1  # and it says why
    assert f"published to this store from artifacts created at {made[0]}" in (
        capsys.readouterr().err
    )
    capsys.readouterr()  # a rollback to the other lineage's point: refused, nothing written
    assert _cli("rollback", other, url, "--to-generation", "1", "--through-seq", "1") == 2
    assert f"created at {made[0]}, not from these" in capsys.readouterr().err
    assert other.list_generations(RUN) == [1]
    assert _cli("verify", first, url, "--all") == 0
    copy = ArtifactRoot(str(tmp_path / "copy"))  # the first lineage, moved to another root
    shutil.copytree(tmp_path / "a", tmp_path / "copy")
    info = copy.read_generation(RUN, 1)
    write_dump(copy, info, 2, {T: {0: random_rows(range(100, 130), TABLES[T], 7)}})
    assert _cli("publish", copy, url) == 0
    assert _cli("verify", copy, url, "--all") == 0


def test_a_generation_registered_without_an_origin_takes_the_first_publishers(backend):
    """A generation registered by ``provision --generation`` (or before origins were kept)
    has none; the first origin given is kept, another refused, none given always passes."""
    with open_store(backend.url, run=RUN) as store:
        store.provision(TABLES)
        registry = store.registry
        registry.register_generation(RUN, 1)
        assert registry.generation_origin(RUN, 1) is None
        registry.register_generation(RUN, 1, "2026-12-07T01:00:00Z")
        assert registry.generation_origin(RUN, 1) == "2026-12-07T01:00:00Z"
        registry.register_generation(RUN, 1, "2026-12-07T01:00:00Z")
        registry.register_generation(RUN, 1)
        with pytest.raises(BadInputError, match=r"created at 2026-12-07T01:00:00Z, not from"):
            registry.register_generation(RUN, 1, "2026-12-07T02:00:00Z")
        registry.register_generation(RUN, 2, "2026-12-07T02:00:00Z")  # per generation
        assert registry.generations(RUN) == [1, 2]
