"""TorchEasyRec's names of embedding tables (``contract=tzrec``), from the modules' types.

Merged TorchEasyRec (``tzrec/utils/delta_embedding_dump.py``, ``_embedding_table_fqn``) names a
table ``<module fqn>.<segment>.<table name>``: the segment is ``embedding_bags`` for a sharded
``EmbeddingBagCollection`` and ``embeddings`` for a sharded ``EmbeddingCollection``, decided by
the module's type, never by its name. The module is the sharded collection itself: for a
managed-collision (ZCH) module that is its inner collection, ``<wrapper>._embedding_module``.
Then INPUT_TILE's user-side twin modules are mapped to the modules serving reads
(``tzrec/utils/checkpoint_util.py``, ``remap_input_tile_user_key``: the first of its patterns
found in the name is replaced).

deltarec's table id is ``<owning module fqn>.<table name>`` (the ZCH wrapper's FQN for a ZCH
table) and GENERATION.json records the collection's type (:attr:`TableSpec.module_type`), so
the name follows from the spec alone, on any machine, without the model.
"""

from __future__ import annotations

from deltarec.artifacts.types import TableKind, TableSpec
from deltarec.errors import ConfigError

SEGMENTS = {"EmbeddingBagCollection": "embedding_bags", "EmbeddingCollection": "embeddings"}
"""The collection's type -> the segment TorchEasyRec puts before the table name."""

INPUT_TILE_USER_REPLACEMENTS: tuple[tuple[str, str], ...] = (
    (".ebc_user.embedding_bags.", ".ebc.embedding_bags."),
    (".mc_ebc_user._embedding_module.", ".mc_ebc._embedding_module."),
    (".mc_ebc_user._managed_collision_collection.", ".mc_ebc._managed_collision_collection."),
    (".ec_dict_user.", ".ec_dict."),
    (".mc_ec_dict_user.", ".mc_ec_dict."),
)
"""TorchEasyRec's INPUT_TILE=3 remapping of user-side module keys, in its order."""


def remap_input_tile_user_key(name: str) -> str:
    """``name`` with the first INPUT_TILE user-side pattern it holds replaced (else as is)."""
    for user, serving in INPUT_TILE_USER_REPLACEMENTS:
        if user in name:
            return name.replace(user, serving)
    return name


def tzrec_embedding_name(table: str, spec: TableSpec) -> str:
    """TorchEasyRec's ``embedding_name`` of table id ``table`` described by ``spec``.

    ``sparse.ebc.user_id`` of an EmbeddingBagCollection is ``sparse.ebc.embedding_bags.user_id``;
    of an EmbeddingCollection ``sparse.ebc.embeddings.user_id``; the ZCH table
    ``sparse.zch.ad_id`` of a ManagedCollisionEmbeddingBagCollection is
    ``sparse.zch._embedding_module.embedding_bags.ad_id``.

    Raises:
        ConfigError: ``spec`` does not say which collection holds the table (artifacts written
            before deltarec recorded it) and the id does not name it either.
    """
    owner, _, name = table.rpartition(".")
    if spec.module_type is None:
        if owner.rpartition(".")[2] in SEGMENTS.values():  # the id names its segment itself
            return remap_input_tile_user_key(table)
        raise ConfigError(
            f"table {table!r}: contract=tzrec names a table by its module's type, and its spec "
            "does not say whether the module is an EmbeddingBagCollection or an "
            "EmbeddingCollection (GENERATION.json written before deltarec recorded "
            "'module_type'); give it: --tables "
            f'\'{{"{table}": {{..., "module_type": "EmbeddingBagCollection"}}}}\', or publish '
            "artifacts of a newer trainer"
        )
    try:
        segment = SEGMENTS[spec.module_type]
    except KeyError:
        raise ConfigError(
            f"table {table!r}: module_type {spec.module_type!r} is not one of {sorted(SEGMENTS)}"
        ) from None
    module = f"{owner}._embedding_module" if TableKind(spec.kind) is TableKind.ZCH else owner
    return remap_input_tile_user_key(".".join(p for p in (module, segment, name) if p))


__all__ = ["INPUT_TILE_USER_REPLACEMENTS", "SEGMENTS", "tzrec_embedding_name"]
