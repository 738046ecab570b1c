"""The strict FeatureStore SDK test double (``tests/stores/sdk``) as tests use it.

:func:`use_test_sdk` points a test (and the commands it starts) at the double: the SDK's
directory goes on ``sys.path`` for the test only and on ``PYTHONPATH`` for its subprocesses,
with a state file, the credential variables and the SDK surface to offer (:data:`SURFACES`:
exactly merged TorchEasyRec's calls by default). The state helpers (create a project, inject a
fault, read or tamper with stored rows) are the double's private ``_state`` module, loaded
from its file.
"""

from __future__ import annotations

import importlib.util
import os
from typing import Any

SDK_DIR = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "stores", "sdk")
"""The directory holding the test ``feature_store_py`` package."""
PROJECT = "proj"
VIEW = "emb"
VERSION = "deltarec"
"""The FeatureStore ``version`` of the first run that registers in a store (``sdk_version``)."""
SURFACES = ("tzrec", "control-plane")
"""The SDK surfaces the backend is tested on: exactly the calls merged TorchEasyRec makes, and
those plus ``project.get_feature_view`` (``untyped``, an SDK older than 2.2.8, is a third)."""
SURFACE_ENV = "FEATURE_STORE_PY_SURFACE"


def version_of(run: str, first: str = VERSION) -> str:
    """The FeatureStore ``version`` a run other than the store's first writes (``first@run``)."""
    return f"{first}@{run}"


_spec = importlib.util.spec_from_file_location(
    "_featurestore_state", os.path.join(SDK_DIR, "feature_store_py", "_state.py")
)
assert _spec is not None and _spec.loader is not None
_state = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_state)

ENV = _state.ENV
connect = _state.connect
create_project = _state.create_project
inject_fault = _state.inject_fault
calls = _state.calls
stored_rows = _state.stored_rows
set_row = _state.set_row


def use_test_sdk(monkeypatch: Any, state: str, surface: str = "tzrec") -> None:
    """Point this test, and the commands it starts, at the test SDK and its state file.

    Sets the Alibaba Cloud credential chain's environment variables (with a security token),
    the FeatureDB login, the SDK ``surface`` (``tzrec``, ``control-plane`` or ``untyped``),
    and creates project :data:`PROJECT`.
    """
    monkeypatch.syspath_prepend(SDK_DIR)
    monkeypatch.setenv(ENV, state)
    monkeypatch.setenv(SURFACE_ENV, surface)
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([SDK_DIR, os.environ.get("PYTHONPATH", "")]))
    monkeypatch.setenv("ALIBABA_CLOUD_ACCESS_KEY_ID", "test-ak")
    monkeypatch.setenv("ALIBABA_CLOUD_ACCESS_KEY_SECRET", "test-secret")
    monkeypatch.setenv("ALIBABA_CLOUD_SECURITY_TOKEN", "test-sts")
    monkeypatch.setenv("FEATUREDB_USERNAME", "fdb-user")
    monkeypatch.setenv("FEATUREDB_PASSWORD", "fdb-pass")
    monkeypatch.delenv("RANK", raising=False)
    create_project(state, PROJECT)
