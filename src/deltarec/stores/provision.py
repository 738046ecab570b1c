"""Provision a store named by URL: create the views of a run's tables, register a generation.

The use case behind ``deltarec provision`` and the pipeline's provision step.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from deltarec.artifacts import ArtifactRoot
from deltarec.artifacts.types import TableSpec
from deltarec.errors import BadInputError
from deltarec.stores.backends import open_store
from deltarec.stores.config import redact_url

__all__ = ["ProvisionResult", "provision_generation", "provision_tables"]


@dataclass(frozen=True)
class ProvisionResult:
    """What provision created.

    Attributes:
        run: the run name.
        generation: the generation whose GENERATION.json listed the tables; None when the
            tables came from the parameters (a fresh run) or nothing was provisioned.
        views: table id -> live view name (empty: no table known yet).
        staging_views: table id -> staging view name (``staged`` with a generation only).
        store: the store URL without credentials.
    """

    run: str
    generation: int | None
    views: dict[str, str]
    staging_views: dict[str, str] = field(default_factory=dict)
    store: str = ""


def provision_tables(
    store_url: str,
    run: str,
    tables: Mapping[str, TableSpec],
    generation: int | None = None,
    staged: bool = False,
    artifacts: str | None = None,
) -> ProvisionResult:
    """Create the live views of ``tables`` (and the generation's staging views if ``staged``).

    Registers ``generation`` when given. Idempotent.

    Raises:
        ViewMismatchError: a view exists with another dim or dtype.
    """
    if staged and generation is None:
        raise BadInputError("staging views need the generation they belong to")
    with open_store(store_url, artifacts, run=run) as store:
        views = store.provision(dict(tables))
        staging = store.provision(dict(tables), staging_generation=generation) if staged else {}
        if generation is not None:
            store.registry.register_generation(run, generation)
    return ProvisionResult(
        run=run,
        generation=generation,
        views={t: v.name for t, v in sorted(views.items())},
        staging_views={t: v.name for t, v in sorted(staging.items())},
        store=redact_url(store_url),
    )


def provision_generation(
    artifacts: str, run: str, store_url: str, generation: int | None = None, staged: bool = False
) -> tuple[ProvisionResult, dict[str, TableSpec]]:
    """Provision the tables of ``generation`` (default: the newest) from its GENERATION.json."""
    root = ArtifactRoot(artifacts)
    gen = generation if generation is not None else root.latest_generation(run)
    tables = root.read_generation(run, gen).tables
    return provision_tables(store_url, run, tables, gen, staged, artifacts), dict(tables)
