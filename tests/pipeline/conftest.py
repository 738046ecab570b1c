import pytest

from deltarec.artifacts import ArtifactRoot, DumpKind, GenerationInfo, Manifest, TableSpec


class FakeArtifact:
    """The attributes a step uses of a KFP artifact."""

    def __init__(self, path, metadata=None):
        self.path = str(path)
        self.uri = str(path)
        self.metadata = dict(metadata or {})
        self.metrics = {}

    def log_metric(self, name, value):
        self.metrics[name] = value
        self.metadata[name] = value


def write_generation(root_uri, run, dumps):
    """A generation with committed dumps; ``dumps`` = [(last_step, {table: rows})]."""
    root = ArtifactRoot(str(root_uri))
    info = root.allocate_generation(
        GenerationInfo(run=run, generation=1, world_size=2, tables={"sparse.ebc.t": TableSpec(8)})
    )
    first = 1
    for seq, (last_step, tables) in enumerate(dumps, start=1):
        root.commit_manifest(
            Manifest(
                run=run,
                generation=info.generation,
                seq=seq,
                kind=DumpKind.DELTA,
                first_step=first,
                last_step=last_step,
                world_size=2,
                shards=(),
                tables=tables,
            )
        )
        first = last_step + 1
    return info.generation


@pytest.fixture
def fake_artifact():
    return FakeArtifact
