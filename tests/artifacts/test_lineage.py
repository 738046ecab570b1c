import numpy as np
import pytest
from tests._helpers.artifacts import TABLE, new_keyed_generation, write_keyed_dump

from deltarec.artifacts import ArtifactRoot, DumpKind, Op, Parent, codec
from deltarec.artifacts.lineage import expected_state, keys_published_after
from deltarec.errors import BadInputError


@pytest.fixture
def root(tmp_path):
    return ArtifactRoot(str(tmp_path / "artifacts"))


def present(state):
    t = state.tables[TABLE]
    keys = t.present_keys()
    rows = codec.decode(t.load(keys), "float32", 4)
    return {int(k): float(r[0]) for k, r in zip(keys, rows, strict=True)}


def test_latest_version_wins_and_evicted_keys_are_absent(root):
    g = new_keyed_generation(root, "r")
    write_keyed_dump(root, "r", g, 0, [1, 2, 3], step=0, kind=DumpKind.SNAPSHOT)
    write_keyed_dump(root, "r", g, 1, [2, 4], step=10)
    write_keyed_dump(root, "r", g, 2, [3], step=20, evicted=(3,))
    assert present(expected_state(root, "r", g)) == {1: 1000, 2: 2010, 4: 4010}
    assert present(expected_state(root, "r", g, through_seq=1)) == {
        1: 1000,
        2: 2010,
        3: 3000,
        4: 4010,
    }
    t = expected_state(root, "r", g).tables[TABLE]
    assert t.ops[t.index_of(np.array([3]))[0]] == Op.EVICTED


def test_snapshot_replaces_keys_it_lacks(root):
    g = new_keyed_generation(root, "r")
    write_keyed_dump(root, "r", g, 0, [1, 2], step=0)
    write_keyed_dump(root, "r", g, 1, [2, 5], step=10, kind=DumpKind.SNAPSHOT)
    write_keyed_dump(root, "r", g, 2, [7], step=20)
    assert present(expected_state(root, "r", g)) == {2: 2010, 5: 5010, 7: 7020}


def test_ancestor_rows_after_the_checkpoint_are_not_expected(root):
    g1 = new_keyed_generation(root, "r")
    write_keyed_dump(root, "r", g1, 0, [1, 2], step=0, kind=DumpKind.SNAPSHOT)
    write_keyed_dump(root, "r", g1, 1, [1], step=50)
    write_keyed_dump(root, "r", g1, 2, [2, 3], step=150)  # after the checkpoint at 100
    g2 = new_keyed_generation(root, "r", parent=Parent(g1, 100))
    assert present(expected_state(root, "r", g2)) == {1: 1050, 2: 2000}
    republish = keys_published_after(root, "r", Parent(g1, 100))
    assert republish[TABLE].tolist() == [2, 3]
    write_keyed_dump(root, "r", g2, 0, [2, 3], step=100)
    assert present(expected_state(root, "r", g2)) == {1: 1050, 2: 2100, 3: 3100}


def test_sibling_generations_are_republished_after_a_restore(root):
    g1 = new_keyed_generation(root, "r")
    write_keyed_dump(root, "r", g1, 0, [1], step=10)
    g2 = new_keyed_generation(root, "r", parent=Parent(g1, 10))
    write_keyed_dump(root, "r", g2, 0, [8, 9], step=20)
    # Generation 3 restores generation 1's checkpoint again: generation 2's keys are suspect.
    assert keys_published_after(root, "r", Parent(g1, 10))[TABLE].tolist() == [8, 9]


def test_unknown_through_seq_is_bad_input(root):
    g = new_keyed_generation(root, "r")
    write_keyed_dump(root, "r", g, 0, [1], step=0)
    write_keyed_dump(root, "r", g, 1, [1], step=5, commit=False)
    with pytest.raises(BadInputError, match="no committed dump 1"):
        expected_state(root, "r", g, through_seq=1)
