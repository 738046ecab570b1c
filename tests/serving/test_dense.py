"""Dense state in the dumps: written before the manifest names it, checked when read, optional."""

from __future__ import annotations

import io
import os
import pathlib
import threading

import numpy as np
import pytest
import torch
from torchrec import EmbeddingBagCollection, EmbeddingBagConfig

from deltarec.artifacts.dense import (
    DENSE_FIELD,
    DenseCapture,
    DenseCommitRoot,
    dense_of,
    read_dense,
)
from deltarec.dump.dense import dense_state
from deltarec.errors import ArtifactError, ChecksumError
from deltarec.serving.replica import Replica

from .conftest import RUN, T_EMB


def _state_bytes(value: float) -> bytes:
    buf = io.BytesIO()
    torch.save({"over.weight": torch.full((2, 3), value)}, buf)
    return buf.getvalue()


def _commit_with_dense(outbox, g, seq, value):
    capture = DenseCapture()
    committing = DenseCommitRoot(outbox.root.uri, None, capture)
    outbox.root, plain = committing, outbox.root
    try:
        capture.settle(outbox.step + 10, lambda: _state_bytes(value))
        return outbox.dump(g, seq, {T_EMB: (np.array([1, 2]), value)})
    finally:
        outbox.root = plain


def test_a_commit_writes_the_captured_state_first_and_names_it_in_the_manifest(outbox):
    g = outbox.first_generation()
    _commit_with_dense(outbox, g, 2, 3.0)
    m = outbox.root.read_manifest(RUN, g, 2)
    info = dense_of(m)
    assert info is not None and info.step == m.last_step and info.path == "dense/state.bin"
    _, data = read_dense(outbox.root, m)
    assert torch.load(io.BytesIO(data), weights_only=True)["over.weight"].sum() == 18.0
    assert dense_of(outbox.root.read_manifest(RUN, g, 1)) is None  # absent: no dense state


def test_a_corrupted_dense_state_is_refused_and_nothing_of_its_dump_is_applied(outbox):
    g = outbox.first_generation()
    replica = Replica(outbox.root, RUN)
    replica.install(replica.load(g, 1))
    _commit_with_dense(outbox, g, 2, 3.0)
    m = outbox.root.read_manifest(RUN, g, 2)
    path = os.path.join(outbox.root.dump_dir(RUN, g, 2), m.extra[DENSE_FIELD]["path"])
    data = bytearray(pathlib.Path(path).read_bytes())
    data[-1] ^= 0xFF
    pathlib.Path(path).write_bytes(bytes(data))
    with pytest.raises(ChecksumError, match="sha256"):
        replica.apply(outbox.root.read_manifest(RUN, g, 2))
    assert replica.current.position.seq == 1 and replica.current.dense is None
    assert replica.read(T_EMB, np.array([1]))[1][0] == (g << 32 | 1)


def test_the_replica_serves_the_dense_state_of_the_newest_dump_that_carries_one(outbox):
    g = outbox.first_generation()
    _commit_with_dense(outbox, g, 2, 3.0)
    outbox.dump(g, 3, {T_EMB: (np.array([5]), 4.0)})  # no dense state: the previous one holds
    replica = Replica(outbox.root, RUN)
    replica.install(replica.load(g, 3))
    dense = replica.current.dense
    assert dense is not None and (dense.generation, dense.seq) == (g, 2)
    assert dense.tensors["over.weight"].sum().item() == 18.0


def test_a_commit_waits_until_the_training_thread_settled_its_step():
    capture = DenseCapture(timeout_s=30)
    got = []
    waiter = threading.Thread(target=lambda: got.append(capture.take(10)))
    waiter.start()
    capture.settle(9)
    waiter.join(0.2)
    assert waiter.is_alive()  # step 10 not settled yet: the commit waits
    capture.settle(10, lambda: b"x")
    waiter.join(10)
    assert got[0]() == b"x" and capture.take(10)() == b"x"  # two dumps at one step
    capture.close()
    assert capture.take(50) is None  # closed: commits go on without a state


def test_a_step_never_settled_fails_the_commit_naming_it():
    with pytest.raises(ArtifactError, match="step 7"):
        DenseCapture(timeout_s=0.05).take(7)


def test_dense_state_leaves_out_the_embedding_modules():
    class Model(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            config = EmbeddingBagConfig(name="t", embedding_dim=4, num_embeddings=10,
                                        feature_names=["f"])  # fmt: skip
            self.ebc = EmbeddingBagCollection([config], device=torch.device("cpu"))
            self.over = torch.nn.Linear(4, 1)
            self.register_buffer("calls", torch.zeros(1))

    state = dense_state(Model())
    assert sorted(state) == ["calls", "over.bias", "over.weight"]


def test_a_dense_cadence_that_is_not_a_whole_number_of_dumps_is_refused(tmp_path, monkeypatch):
    from deltarec.dump import make_train_hook
    from deltarec.errors import ConfigError

    with pytest.raises(ConfigError, match="dense_every"):
        make_train_hook(artifacts=str(tmp_path), run="r", every_steps=5, dense_every=0)
    monkeypatch.setenv("DELTAREC_DENSE_EVERY", "often")
    with pytest.raises(ConfigError, match="DELTAREC_DENSE_EVERY='often'"):
        make_train_hook(artifacts=str(tmp_path), run="r", every_steps=5)
    monkeypatch.setenv("DELTAREC_DENSE_EVERY", "3")
    assert make_train_hook(artifacts=str(tmp_path), run="r", every_steps=5).dense.every == 3
