"""Fixtures of the reliability tests: an S3-compatible artifact root (moto), and helpers to run
``deltarec train`` as a user does and to find, pause and kill its process tree."""

from __future__ import annotations

from collections.abc import Iterator

import pytest


@pytest.fixture
def s3_uri() -> Iterator[tuple[str, dict[str, object]]]:
    """``(uri, storage_options)`` of an empty prefix on a moto S3 server of this test."""
    moto_server = pytest.importorskip("moto.server")
    s3fs = pytest.importorskip("s3fs")
    from deltarec.testing.multiprocess import free_port

    port = free_port()
    server = moto_server.ThreadedMotoServer(ip_address="127.0.0.1", port=port)
    server.start()
    opts: dict[str, object] = {
        "key": "test",
        "secret": "test",
        "client_kwargs": {"endpoint_url": f"http://127.0.0.1:{port}"},
    }
    s3fs.S3FileSystem(**opts).mkdir("deltarec-lease")
    s3fs.S3FileSystem.clear_instance_cache()
    try:
        yield "s3://deltarec-lease/artifacts", opts
    finally:
        server.stop()


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
