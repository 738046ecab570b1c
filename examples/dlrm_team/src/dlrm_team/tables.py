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


def table_ids() -> list[str]:
    """The deltarec table ids of the model's tables (module FQN + table name)."""
    return [f"{EBC_FQN}.{name}" for name in TABLES]


def tables_parameter() -> str:
    """The pipeline's ``tables`` parameter for this model."""
    return json.dumps(
        {f"{EBC_FQN}.{name}": {"dim": EMBEDDING_DIM} for name in TABLES}, sort_keys=True
    )


if __name__ == "__main__":
    print(tables_parameter())
