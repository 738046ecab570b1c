"""The model's embedding tables, and the ``tables`` pipeline parameter that lists them.

``python -m dlrm_team.tables`` prints the JSON object the pipeline's ``tables`` parameter
takes, so provision can create the store views before the first training step.
"""

from __future__ import annotations

import json

EMBEDDING_DIM = 8
"""DLRM needs one embedding dimension for every table."""

TABLES = {"t_user": ("f_user", 400), "t_item": ("f_item", 600), "t_site": ("f_site", 50)}
"""Table name -> (feature name, rows)."""

EBC_FQN = "dlrm.sparse_arch.embedding_bag_collection"
"""Where the model keeps DLRM's EmbeddingBagCollection (the table ids' module part)."""

SEQ_DIM = 4
SEQ_TABLES = {"t_item_seq": ("f_item", 600)}
"""Tables of the item-sequence tower's EmbeddingCollection: ``f_item`` feeds both modules."""

EC_FQN = "item_seq.ec"
"""Where the model keeps the sequence tower's EmbeddingCollection."""


def table_ids() -> list[str]:
    """The deltarec table ids of the model's tables (module FQN + table name)."""
    return [f"{EBC_FQN}.{name}" for name in TABLES] + [f"{EC_FQN}.{name}" for name in SEQ_TABLES]


def tables_parameter() -> str:
    """The pipeline's ``tables`` parameter for this model."""
    tables = {f"{EBC_FQN}.{name}": {"dim": EMBEDDING_DIM} for name in TABLES}
    tables.update({f"{EC_FQN}.{name}": {"dim": SEQ_DIM} for name in SEQ_TABLES})
    return json.dumps(tables, sort_keys=True)


if __name__ == "__main__":
    print(tables_parameter())
