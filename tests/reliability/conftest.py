"""Fixtures of the reliability tests: an S3-compatible artifact root (SeaweedFS), and helpers to run
``deltarec train`` as a user does and to find, pause and kill its process tree."""

from __future__ import annotations

from collections.abc import Iterator

import pytest


@pytest.fixture
def s3_uri(s3_server) -> Iterator[tuple[str, dict[str, object]]]:
    """``(uri, storage_options)`` of an empty prefix in a fresh bucket of a real S3-compatible
    server (SeaweedFS, session-wide: tests/conftest.py)."""
    uri, opts = s3_server.fresh_uri()
    yield f"{uri}/artifacts", opts


LONG_ENV = "DELTAREC_FAULTS_LONG"


def pytest_collection_modifyitems(config, items):
    """The long fault campaign runs only on demand: ``-m faults_long`` or DELTAREC_FAULTS_LONG=1."""
    import os

    wanted = os.environ.get(LONG_ENV) == "1" or "faults_long" in (config.option.markexpr or "")
    if wanted:
        return
    skip = pytest.mark.skip(reason=f"long fault campaign: run with -m faults_long or {LONG_ENV}=1")
    for item in items:
        if item.get_closest_marker("faults_long") is not None:
            item.add_marker(skip)
