"""A small training program for the pipeline tests that can lose one published row.

Run as the pipeline's entry point ``lossy_team:main`` (one rank): it reads the ``DELTAREC_*``
settings, writes one generation of table ``m.t`` (keys 0..19, values seeded by the
generation) with deltarec's artifact writer, and publishes it with deltarec's publisher in the
run's publish mode. With ``--lose-key K`` the store never gets key K of that dump (a lost
write), so verify finds it MISSING and fails. Torch-free, so a pipeline run takes seconds.
"""

import argparse
import sys

import numpy as np

from deltarec.api import TableSpec, TrainSettings
from deltarec.artifacts import ArtifactRoot, ShardRows
from deltarec.artifacts.types import DumpKind
from deltarec.publish import DumpPublisher
from deltarec.stores import open_store
from deltarec.testing.dumps import new_generation, random_rows, write_dump

TABLE = "m.t"
SPEC = TableSpec(dim=4)
KEYS = np.arange(20, dtype=np.int64)


def rows_of(generation):
    """The rows generation ``generation`` writes (what the test expects after a replay)."""
    return random_rows(KEYS, SPEC, seed=generation, step=10)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--lose-key", type=int, default=None)
    args = parser.parse_args(sys.argv[1:])
    settings = TrainSettings.from_env()
    root = ArtifactRoot(settings.artifacts)
    info = new_generation(root, settings.run, {TABLE: SPEC}, world_size=1)
    rows = rows_of(info.generation)
    manifest = write_dump(
        root,
        info,
        1,
        {TABLE: {0: rows}},
        kind=DumpKind.DELTA,
        first_step=1,
        last_step=settings.steps or 10,
    )
    if args.lose_key is not None:
        keep = rows.keys != args.lose_key
        rows = ShardRows(rows.keys[keep], rows.embedding[keep], rows.ops[keep], rows.steps[keep])
    with open_store(settings.store, run=settings.run) as store:
        DumpPublisher(store, root, settings.run, mode=settings.publish_mode).publish_dump(
            manifest, 0, {TABLE: rows}
        )
    return 0
