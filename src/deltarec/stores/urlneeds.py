"""What a store URL asks of the process before any store is opened.

Training reads these from the URL alone, before it starts ranks: whether the store's SDK is
installed (:func:`require_sdk`) and whether the dumper must write the ZCH ids the model answers
with its fallback row (:func:`wants_zch_misses`). No backend module is imported here.
"""

from __future__ import annotations

import importlib
from typing import Any

from deltarec.errors import ConfigError
from deltarec.stores.config import FeatureStoreConfig, parse_store_url


def import_module(name: str, what: str) -> Any:
    """Import an optional module or raise a :class:`ConfigError` saying how to install it."""
    try:
        return importlib.import_module(name)
    except ImportError as e:
        raise ConfigError(
            f"the featurestore store needs {name!r} ({what}); it is not installed"
        ) from e


def require_sdk(url: str | None) -> None:
    """For a ``featurestore://`` URL: raise :class:`ConfigError` naming the SDK if it is missing.

    Commands that start other processes (``deltarec train``) call it first, so the refusal
    comes once, before any rank starts. Other URLs: nothing.
    """
    if url and url.strip().lower().startswith("featurestore:"):
        import_module("feature_store_py", "the FeatureStore SDK wheel")
        import_module("alibabacloud_credentials.client", "alibabacloud-credentials")


def wants_zch_misses(url: str) -> bool:
    """Whether the store at ``url`` needs the ZCH ids the model answers with its fallback row.

    True for a ``featurestore://`` URL with ``contract=tzrec``: TorchEasyRec publishes every
    ZCH id training looked up, held or not, and its serving finds no row for an id it did not
    publish; the dumper's ``zch_misses`` setting writes those ids (``op = 1``, fallback row).

    Raises:
        ConfigError: ``url`` is a ``featurestore://`` URL that does not parse.
    """
    if not url.lower().startswith("featurestore:"):
        return False
    config = parse_store_url(url)
    return isinstance(config, FeatureStoreConfig) and config.contract == "tzrec"


__all__ = ["import_module", "require_sdk", "wants_zch_misses"]
