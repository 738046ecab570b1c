"""``contract=tzrec`` names tables as TorchEasyRec does, from the modules' types.

On a DMP-sharded model with an EmbeddingBagCollection (one named ``cabbage``, whose name says
nothing), an EmbeddingCollection, INPUT_TILE user-side twins, and managed-collision bag and
sequence modules, the names deltarec derives from what GENERATION.json records are compared
with the names TorchEasyRec's own code produces for the same model: a transcription of merged
TorchEasyRec's ``ModelDeltaTracker`` naming (``tzrec/utils/delta_embedding_dump.py``,
``_embedding_table_fqn``) and its INPUT_TILE remapping (``tzrec/utils/checkpoint_util.py``).
"""

from __future__ import annotations

import pytest
import torch

from deltarec.artifacts.types import TableSpec
from deltarec.errors import ConfigError
from deltarec.stores.featurestore.tzrec import tzrec_embedding_name
from deltarec.testing.multiprocess import run_on_ranks

pytestmark = pytest.mark.multiprocess

_TZREC_PREFIXES = ("_dmp_wrapped_module.module.", "_dmp_wrapped_module.", "module.")
_TZREC_USER = (
    (".ebc_user.embedding_bags.", ".ebc.embedding_bags."),
    (".mc_ebc_user._embedding_module.", ".mc_ebc._embedding_module."),
    (".mc_ebc_user._managed_collision_collection.", ".mc_ebc._managed_collision_collection."),
    (".ec_dict_user.", ".ec_dict."),
    (".mc_ec_dict_user.", ".mc_ec_dict."),
)


def torcheasyrec_names(model: torch.nn.Module) -> set[str]:
    """The table names TorchEasyRec's delta dump gives the tables of a sharded ``model``."""
    from torchrec.distributed.embedding import ShardedEmbeddingCollection
    from torchrec.distributed.embeddingbag import ShardedEmbeddingBagCollection

    names = set()
    for named_fqn, module in model.named_modules():
        if not isinstance(module, (ShardedEmbeddingCollection, ShardedEmbeddingBagCollection)):
            continue
        module_fqn = module._module_fqn
        if not module_fqn:
            module_fqn = named_fqn
            for prefix in _TZREC_PREFIXES:
                if named_fqn.startswith(prefix):
                    module_fqn = named_fqn[len(prefix) :]
                    break
        segment = (
            "embedding_bags" if isinstance(module, ShardedEmbeddingBagCollection) else "embeddings"
        )
        for table_name in module._table_name_to_config:
            fqn = ".".join(filter(None, (module_fqn, segment, table_name)))
            for user, serving in _TZREC_USER:
                if user in fqn:
                    fqn = fqn.replace(user, serving)
                    break
            names.add(fqn)
    return names


class _Tower(torch.nn.Module):
    def __init__(self) -> None:
        from torchrec import (
            EmbeddingBagCollection,
            EmbeddingBagConfig,
            EmbeddingCollection,
            EmbeddingConfig,
        )

        super().__init__()

        def bags(name: str) -> EmbeddingBagCollection:
            cfg = EmbeddingBagConfig(
                name=name, embedding_dim=4, num_embeddings=10, feature_names=[f"f_{name}"]
            )
            return EmbeddingBagCollection(tables=[cfg], device=torch.device("meta"))

        def seqs(name: str) -> EmbeddingCollection:
            cfg = EmbeddingConfig(
                name=name, embedding_dim=4, num_embeddings=10, feature_names=[f"f_{name}"]
            )
            return EmbeddingCollection(tables=[cfg], device=torch.device("meta"))

        self.ebc = bags("user_id")
        self.ebc_user = bags("user_id_u")  # INPUT_TILE's user-side twin
        self.cabbage = bags("geo")  # a bag module whose name says nothing
        self.ec_dict = seqs("hist")
        self.ec_dict_user = seqs("hist_u")
        self.bagged = seqs("clicks")  # a sequence module whose name says "bag"


class _Model(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.model = _Tower()
        self.dense = torch.nn.Linear(4, 1)


def _names_on_one_rank(rank: int, world_size: int) -> tuple[set[str], set[str], set[str]]:
    from tests._helpers.zch import build_sharded
    from torchrec.distributed.model_parallel import DistributedModelParallel

    from deltarec.tracking.discovery import discover_plain_sources
    from deltarec.tracking.zch import discover_zch_sources

    plain = DistributedModelParallel(_Model(), device=torch.device("cpu"))
    zch, _ = build_sharded(world_size)
    ours: set[str] = set()
    theirs = torcheasyrec_names(plain) | torcheasyrec_names(zch)
    ids: set[str] = set()
    for model, discover in ((plain, discover_plain_sources), (zch, discover_zch_sources)):
        sources = discover(model)
        try:
            for s in sources:
                spec = TableSpec.from_json(s.spec.to_json())  # as GENERATION.json carries it
                ours.add(tzrec_embedding_name(s.table_id, spec))
                ids.add(s.table_id)
        finally:
            for s in sources:
                s.close()
    return ours, theirs, ids


def test_tzrec_names_follow_module_types_exactly_as_torcheasyrec_names_them():
    ((ours, theirs, ids),) = run_on_ranks(_names_on_one_rank, world_size=1, timeout_s=300)
    assert ours == theirs
    assert {
        "model.ebc.embedding_bags.user_id",
        "model.ebc.embedding_bags.user_id_u",  # ebc_user remapped to the serving module
        "model.cabbage.embedding_bags.geo",
        "model.ec_dict.embeddings.hist",
        "model.ec_dict.embeddings.hist_u",
        "model.bagged.embeddings.clicks",
        "mc_ebc._embedding_module.embedding_bags.bag",
        "mc_ec._embedding_module.embeddings.seq",
    } == ours
    assert "model.cabbage.geo" in ids and "mc_ec.seq" in ids


def test_a_spec_without_its_module_type_is_refused_under_tzrec_saying_what_to_give():
    with pytest.raises(ConfigError, match=r"'sparse.ebc.user_id'.*module_type"):
        tzrec_embedding_name("sparse.ebc.user_id", TableSpec(dim=4))
    spec = TableSpec(dim=4)  # an id that names its segment itself needs nothing more
    assert tzrec_embedding_name("m.ebc_user.embedding_bags.t", spec) == "m.ebc.embedding_bags.t"
