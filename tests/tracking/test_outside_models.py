"""Models written the way outside teams write them, dumped through the public hook on 2 ranks.

torchrec's own ``DLRM`` / ``DLRM_DCN`` over an EmbeddingBagCollection plus a small sequence
tower on an EmbeddingCollection, sharded on 2 CPU ranks (gloo) by torchrec's planner
(``EmbeddingShardingPlanner``) with fused optimizers, trained by a hand-written loop that drives
``make_train_hook``. The layouts defeat torchrec's delta tracker: a table and a module of the
same name (``history``), one table name in two modules (``t_item``), one feature feeding
tables of two modules (``f_item``); the planner is steered to table-column-wise, column-wise,
table-wise, row-wise and data-parallel tables.

Every dump is checked against the model's tables at that dump's step, gathered on rank 0
inside the training loop: the replay of the artifacts through that dump equals every row of
every table, and each delta holds exactly the rows looked up in training since the previous
dump (evaluation lookups excluded).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pytest

from deltarec.testing.multiprocess import run_on_ranks

pytestmark = pytest.mark.multiprocess

DIM = 32  # DLRM needs one dim for all its tables
SEQ_DIM = 8
BATCH = 8
EVERY = 3
STEPS = 9
EVAL_AT = 4


@dataclass(frozen=True)
class Table:
    """One embedding table of a layout: name, features, rows and the planner's options."""

    name: str
    features: tuple[str, ...]
    rows: int
    shardings: tuple[str, ...]
    min_partition: int | None = None


@dataclass(frozen=True)
class Layout:
    """A model: DLRM or DLRM_DCN over ``bags`` plus a sequence tower over ``seqs`` (``arch``
    ``dlrm``/``dcn``), or a bare EmbeddingBagCollection with no dense parameter (``bags``)."""

    name: str
    arch: str
    bags: tuple[Table, ...]
    seqs: tuple[Table, ...]
    linear: str  # the tower's output layer, registered after its EmbeddingCollection
    seed: int

    def feature_rows(self) -> dict[str, int]:
        out: dict[str, int] = {}
        for t in self.bags + self.seqs:
            for f in t.features:
                out[f] = min(out.get(f, t.rows), t.rows)
        return out


CLASH = Layout(
    name="clash",
    arch="dlrm",
    bags=(
        Table("t_user", ("f_user",), 200, ("table_column_wise",), 8),
        Table("t_item", ("f_item",), 150, ("table_wise",)),
        Table("t_cat", ("f_cat",), 60, ("column_wise",), 16),
        Table("t_ctx", ("f_ctx",), 40, ("data_parallel",)),
    ),
    seqs=(
        Table("history", ("f_hist",), 120, ("row_wise",)),
        Table("t_item", ("f_item_seq",), 80, ("table_wise",)),
    ),
    linear="history",
    seed=1,
)
SHARED = Layout(
    name="shared",
    arch="dcn",
    bags=(
        Table("a", ("f_a",), 100, ("table_wise", "column_wise", "table_column_wise"), 16),
        Table("b", ("f_item",), 90, ("table_column_wise",), 16),
        Table("c", ("f_c",), 70, ("table_wise",)),
    ),
    seqs=(
        Table("s_item", ("f_item",), 90, ("row_wise",)),
        Table("s_hist", ("f_s",), 50, ("table_wise", "row_wise")),
    ),
    linear="head",
    seed=2,
)
BAGS_ONLY = Layout(
    name="bags_only",
    arch="bags",
    bags=(
        Table("u", ("f_u",), 80, ("table_wise",)),
        Table("v", ("f_v",), 60, ("column_wise",), 16),
    ),
    seqs=(),
    linear="",
    seed=3,
)


# ---- the model, as an outside team writes it ---------------------------------------------


def _build(layout: Layout):
    import torch
    from torch import nn
    from torchrec import (
        EmbeddingBagCollection,
        EmbeddingBagConfig,
        EmbeddingCollection,
        EmbeddingConfig,
    )
    from torchrec.models.dlrm import DLRM, DLRM_DCN

    def on_meta(collection, config, dim, tables):
        """A ``collection`` of ``tables`` (``config`` each, ``dim`` wide) on the meta device."""
        return collection(
            tables=[
                config(
                    name=t.name,
                    embedding_dim=dim,
                    num_embeddings=t.rows,
                    feature_names=list(t.features),
                )
                for t in tables
            ],
            device=torch.device("meta"),
        )

    class SeqTower(nn.Module):
        """Sum-pools each sequence, then one linear layer (named ``layout.linear``)."""

        def __init__(self) -> None:
            super().__init__()
            self.ec = on_meta(EmbeddingCollection, EmbeddingConfig, SEQ_DIM, layout.seqs)
            setattr(self, layout.linear, nn.Linear(SEQ_DIM, 1))

        def forward(self, seqs):
            out = self.ec(seqs)
            pooled = 0
            for jt in out.values():
                lengths = jt.lengths()
                row = torch.repeat_interleave(torch.arange(lengths.numel()), lengths)
                pooled = pooled + torch.zeros(lengths.numel(), SEQ_DIM).index_add(
                    0, row, jt.values()
                )
            return getattr(self, layout.linear)(pooled).squeeze(1)

    def bag_collection():
        return on_meta(EmbeddingBagCollection, EmbeddingBagConfig, DIM, layout.bags)

    class Ranker(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            if layout.arch == "dcn":
                self.dlrm = DLRM_DCN(bag_collection(), 4, [16, DIM], [16, 1], 2, 8)
            else:
                self.dlrm = DLRM(bag_collection(), 4, [16, DIM], [16, 1])
            self.seq = SeqTower()

        def forward(self, dense, bags, seqs, labels):
            logits = self.dlrm(dense, bags).squeeze(1) + self.seq(seqs)
            return nn.functional.binary_cross_entropy_with_logits(logits, labels)

    class BagsOnly(nn.Module):
        """Only embedding tables: the logit is the sum of the pooled embeddings."""

        def __init__(self) -> None:
            super().__init__()
            self.ebc = bag_collection()

        def forward(self, dense, bags, seqs, labels):
            logits = self.ebc(bags).values().sum(dim=1)
            return nn.functional.binary_cross_entropy_with_logits(logits, labels)

    return BagsOnly() if layout.arch == "bags" else Ranker()


def _shard(layout: Layout):
    import torch
    import torch.distributed as dist
    from torchrec.distributed.embedding import EmbeddingCollectionSharder
    from torchrec.distributed.embeddingbag import EmbeddingBagCollectionSharder
    from torchrec.distributed.model_parallel import DistributedModelParallel
    from torchrec.distributed.planner import (
        EmbeddingShardingPlanner,
        ParameterConstraints,
        Topology,
    )
    from torchrec.optim.apply_optimizer_in_backward import apply_optimizer_in_backward
    from torchrec.optim.keyed import CombinedOptimizer, KeyedOptimizerWrapper
    from torchrec.optim.optimizers import in_backward_optimizer_filter
    from torchrec.optim.rowwise_adagrad import RowWiseAdagrad

    torch.manual_seed(layout.seed)
    model = _build(layout)
    bags_only = layout.arch == "bags"
    ebc = model.ebc if bags_only else model.dlrm.sparse_arch.embedding_bag_collection
    seq = [] if bags_only else list(model.seq.ec.parameters())
    fused = [
        p
        for n, p in ebc.named_parameters()
        if not any(
            n.split(".")[-2] == t.name and "data_parallel" in t.shardings for t in layout.bags
        )
    ]
    apply_optimizer_in_backward(RowWiseAdagrad, fused + seq, {"lr": 0.1})
    constraints: dict[str, ParameterConstraints] = {}
    for t in layout.bags + layout.seqs:  # keyed by table name, as torchrec's planner wants
        constraints[t.name] = ParameterConstraints(
            sharding_types=list(t.shardings), min_partition=t.min_partition
        )
    sharders = [EmbeddingBagCollectionSharder(), EmbeddingCollectionSharder()]
    planner = EmbeddingShardingPlanner(
        topology=Topology(world_size=dist.get_world_size(), compute_device="cpu"),
        constraints=constraints,
    )
    plan = planner.collective_plan(model, sharders, dist.GroupMember.WORLD)
    dmp = DistributedModelParallel(model, device=torch.device("cpu"), plan=plan, sharders=sharders)
    dense = dict(in_backward_optimizer_filter(dmp.named_parameters()))
    parts: list = [("fused", dmp.fused_optimizer)]
    if dense:
        sgd = KeyedOptimizerWrapper(dense, lambda ps: torch.optim.SGD(ps, lr=0.05))
        parts.append(("dense", sgd))
    return dmp, CombinedOptimizer(parts)


def _ids(layout: Layout, step: int, rank: int, kind: int) -> dict[str, tuple]:
    """``{feature: (lengths, ids)}`` of one rank's batch (kind 0: training, 1: evaluation)."""
    rng = np.random.default_rng([layout.seed, step, rank, kind])
    out = {}
    for feature, rows in layout.feature_rows().items():
        lengths = rng.integers(1, 4, size=BATCH)
        out[feature] = (lengths, rng.integers(0, rows, size=int(lengths.sum())))
    return out


def _batch(layout: Layout, step: int, rank: int, kind: int = 0):
    import torch
    from torchrec import KeyedJaggedTensor

    ids = _ids(layout, step, rank, kind)

    def kjt(tables):
        keys = sorted({f for t in tables for f in t.features})
        if not keys:
            return None
        return KeyedJaggedTensor.from_lengths_sync(
            keys=keys,
            values=torch.from_numpy(np.concatenate([ids[k][1] for k in keys])),
            lengths=torch.from_numpy(np.concatenate([ids[k][0] for k in keys])).int(),
        )

    rng = np.random.default_rng([layout.seed, step, rank, kind, 7])
    dense = torch.from_numpy(rng.standard_normal((BATCH, 4)).astype(np.float32))
    labels = torch.from_numpy(rng.integers(0, 2, BATCH).astype(np.float32))
    return dense, kjt(layout.bags), kjt(layout.seqs), labels


def _tables(dmp) -> dict[str, tuple]:
    """``{table id: (module, attr, name)}`` of every sharded table, as the user names it."""
    from torchrec.distributed.embedding import ShardedEmbeddingCollection
    from torchrec.distributed.embeddingbag import ShardedEmbeddingBagCollection

    from deltarec.ids import table_id

    out = {}
    for fqn, mod in dmp.named_modules():
        if isinstance(mod, (ShardedEmbeddingBagCollection, ShardedEmbeddingCollection)):
            attr = (
                "embedding_bags" if isinstance(mod, ShardedEmbeddingBagCollection) else "embeddings"
            )
            for name in mod._table_name_to_config:
                out[table_id(fqn, name)] = (mod, attr, name)
    return out


def _full_tables(dmp, rank: int) -> dict[str, np.ndarray]:
    """Every table's rows, gathered whole on rank 0 (a collective; empty on other ranks)."""
    import torch

    out = {}
    for tid, (mod, attr, name) in sorted(_tables(dmp).items()):
        value = mod.state_dict()[f"{attr}.{name}.weight"]
        if hasattr(value, "local_shards"):
            full = torch.empty(value.size()) if rank == 0 else None
            value.gather(dst=0, out=full)
        else:
            full = value.detach().clone()
        if rank == 0:
            out[tid] = full.numpy().copy()
    return out


# ---- the training loop, as an outside team writes it ---------------------------------------


def _train(layout: Layout, rank: int, artifacts: str) -> dict:
    import torch

    from deltarec.dump import make_train_hook

    dmp, optimizer = _shard(layout)
    hook = make_train_hook(
        artifacts=artifacts, run=layout.name, every_steps=EVERY, chunk_rows=64, fsync=False
    )
    at_dump = {}
    losses = []
    try:
        hook.on_start(dmp, 0, None)
        at_dump[0] = _full_tables(dmp, rank)
        for step in range(1, STEPS + 1):
            optimizer.zero_grad()
            loss = dmp(*_batch(layout, step, rank))
            loss.backward()
            optimizer.step()
            losses.append(float(loss))
            hook.after_step(step)
            if step % EVERY == 0:
                at_dump[step] = _full_tables(dmp, rank)
            if step == EVAL_AT:
                hook.before_eval()
                dmp.eval()
                with torch.no_grad():
                    dmp(*_batch(layout, step, rank, kind=1))
                dmp.train()
                hook.after_eval()
        hook.on_end(STEPS)
        via = {
            s.table_id: ("torchrec" if s.fqn in s.hub.tracker_fqns else "deltarec")
            for s in hook.dumper.sources
        }
    finally:
        hook.close()
    from deltarec.ids import table_id

    ranks = {
        table_id(module, name): sorted(set(param.ranks or ()))
        for module, params in dmp.plan.plan.items()
        for name, param in params.items()
    }
    return {"at_dump": at_dump, "losses": losses, "via": via, "ranks": ranks, "dmp": dmp}


def _interfere(layout: Layout, rank: int, artifacts: str, dmp, run: str, action) -> str:
    """Start a dumper, let ``action(dmp)`` change the hooks, train a step: the dump's error."""
    from deltarec.dump import make_train_hook
    from deltarec.tracking.errors import TrackingError

    hook = make_train_hook(artifacts=artifacts, run=run, every_steps=1, snapshot=False, fsync=False)
    try:
        hook.on_start(dmp, 0, None)
        action(dmp)
        dmp(*_batch(layout, 1, rank)).backward()
        try:
            hook.after_step(1)
        except TrackingError as e:
            return f"TrackingError: {e}"
        return "no error"
    finally:
        hook.close()


def _reattach_to_tower(dmp) -> None:
    """torchrec's tracker attached again to the tower's EmbeddingCollection."""
    dmp.module.seq.ec.register_post_lookup_tracker_fn(dmp.get_delta_tracker().record_lookup)


def _replace_bag_hook(dmp) -> None:
    """Another post-lookup function on the EBC, registered after the dumper started."""
    ebc = dmp.module.dlrm.sparse_arch.embedding_bag_collection
    ebc.register_post_lookup_tracker_fn(lambda *args: None)


def _ranks(rank: int, world_size: int, artifacts: str) -> dict:
    out = {}
    for layout in (CLASH, SHARED, BAGS_ONLY):
        out[layout.name] = _train(layout, rank, artifacts)
    clash_dmp, shared_dmp = out["clash"].pop("dmp"), out["shared"].pop("dmp")
    out["bags_only"].pop("dmp")
    out["errors"] = {
        "unknown path": _interfere(CLASH, rank, artifacts, clash_dmp, "u", _reattach_to_tower),
        "reattached": _interfere(SHARED, rank, artifacts, shared_dmp, "r", _reattach_to_tower),
        "replaced": _interfere(SHARED, rank, artifacts, shared_dmp, "x", _replace_bag_hook),
    }
    return out


# ---- the checks, dump by dump -----------------------------------------------------------


def _touched(layout: Layout, table_features: dict[str, tuple[str, ...]], first: int, last: int):
    """Rows of each table looked up in training by any rank in steps ``first..last``."""
    out: dict[str, set[int]] = {tid: set() for tid in table_features}
    for step in range(first, last + 1):
        for rank in range(2):
            ids = _ids(layout, step, rank, 0)
            for tid, features in table_features.items():
                for f in features:
                    out[tid].update(int(i) for i in ids[f][1])
    return out


def _check_layout(root, layout: Layout, result: dict, prefix_bag: str, prefix_seq: str) -> None:
    from deltarec.artifacts import read_shard
    from deltarec.artifacts.lineage import expected_state

    run = layout.name
    features = {f"{prefix_bag}.{t.name}": t.features for t in layout.bags}
    features.update({f"{prefix_seq}.{t.name}": t.features for t in layout.seqs})
    info = root.read_generation(run, 1)
    assert set(info.tables) == set(features)
    assert all(np.isfinite(result["losses"]))
    dumps = root.list_dumps(run, 1)
    assert dumps == list(range(STEPS // EVERY + 2))  # snapshot, deltas, final (empty)
    at_dump = result["at_dump"]
    previous = 0
    for seq in dumps:
        m = root.read_manifest(run, 1, seq)
        state = at_dump[m.last_step]
        assert set(state) == set(features)
        replay = expected_state(root, run, 1, through_seq=seq)
        for tid, rows in state.items():
            et = replay.tables[tid]
            keys = np.arange(rows.shape[0])
            live = np.sort(et.keys[et.ops == 0])
            assert np.array_equal(live, keys), (run, seq, tid)
            np.testing.assert_array_equal(et.load(keys), rows, err_msg=f"{run} dump {seq} {tid}")
        if m.kind.value == "snapshot":
            continue
        want = _touched(layout, features, previous + 1, m.last_step)
        ddir = root.dump_dir(run, 1, seq)
        for tid in features:
            got = [read_shard(root, ddir, s, info.tables[tid].dtype).keys for s in m.shards_of(tid)]
            keys = np.sort(np.concatenate(got)) if got else np.empty(0, np.int64)
            assert np.array_equal(keys, np.array(sorted(want[tid]))), (run, seq, tid)
        previous = m.last_step


def test_outside_models_dump_every_table_right_at_every_dump_on_two_ranks(tmp_path):
    from deltarec.artifacts import ArtifactRoot

    results = run_on_ranks(_ranks, 2, args=(str(tmp_path),), timeout_s=300)
    root = ArtifactRoot(str(tmp_path))
    r0 = results[0]

    # torchrec's planner chose what each layout asked for, table-column-wise over both ranks
    clash_info = root.read_generation("clash", 1)
    shardings = {t: s.sharding for t, s in clash_info.tables.items()}
    assert shardings["dlrm.sparse_arch.embedding_bag_collection.t_user"] == "table_column_wise"
    assert shardings["seq.ec.history"] == "row_wise"
    assert {"table_wise", "column_wise", "data_parallel"} <= set(shardings.values())
    assert (
        root.read_generation("shared", 1)
        .tables["dlrm.sparse_arch.embedding_bag_collection.b"]
        .sharding
        == "table_column_wise"
    )
    assert r0["clash"]["ranks"]["dlrm.sparse_arch.embedding_bag_collection.t_user"] == [0, 1]
    assert r0["shared"]["ranks"]["dlrm.sparse_arch.embedding_bag_collection.b"] == [0, 1]

    # where torchrec's tracker cannot attribute lookups, deltarec records them itself
    bag = "dlrm.sparse_arch.embedding_bag_collection"
    assert set(r0["clash"]["via"].values()) == {"deltarec"}  # history clash, t_item twice
    via = r0["shared"]["via"]
    assert {via[f"{bag}.{t}"] for t in ("a", "b", "c")} == {"torchrec"}
    assert {via["seq.ec.s_item"], via["seq.ec.s_hist"]} == {"deltarec"}  # f_item in both
    assert set(r0["bags_only"]["via"].values()) == {"deltarec"}  # torchrec's cannot attach

    _check_layout(root, CLASH, r0["clash"], bag, "seq.ec")
    _check_layout(root, SHARED, r0["shared"], bag, "seq.ec")
    _check_layout(root, BAGS_ONLY, r0["bags_only"], "ebc", "")

    # a lookup torchrec files under a path no table has stops the dump, naming table and path
    for r in results:
        errors = r["errors"]
        unknown = errors["unknown path"]
        assert unknown.startswith("TrackingError"), unknown
        assert "'seq.ec.history'" in unknown and "'seq.history'" in unknown
        # torchrec's tracker attached again where it would misfile under a known path
        assert errors["reattached"].startswith("TrackingError"), errors["reattached"]
        assert "'seq.ec.s_" in errors["reattached"] and "attached" in errors["reattached"]
        # a module torchrec's tracker stopped recording: its tables are named
        assert errors["replaced"].startswith("TrackingError"), errors["replaced"]
        assert f"{bag}.b" in errors["replaced"] and "no longer records" in errors["replaced"]
        assert "_dmp_wrapped_module" not in "".join(errors.values())
    for run in ("u", "r", "x"):
        assert root.list_dumps(run, 1) == []
