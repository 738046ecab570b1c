"""images/install-featurestore-wheel.sh: the SDK wheel goes into an image only with its sha256."""

from __future__ import annotations

import hashlib
import os
import pathlib
import subprocess

SCRIPT = pathlib.Path(__file__).resolve().parents[2] / "images" / "install-featurestore-wheel.sh"


def _run(tmp_path, wheel, sha):
    """Run the script with a recording ``pip`` first on PATH; (exit code, pip's calls)."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    log = tmp_path / "pip.log"
    (bin_dir / "pip").write_text(f'#!/bin/sh\necho "$@" >> {log}\n')
    (bin_dir / "pip").chmod(0o755)
    env = {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}"}
    out = subprocess.run(
        ["sh", str(SCRIPT), wheel, sha, str(tmp_path / "context")],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    calls = log.read_text().splitlines() if log.exists() else []
    return out.returncode, calls, out.stdout + out.stderr


def _wheel(tmp_path) -> tuple[str, str]:
    context = tmp_path / "context" / "wheels"
    context.mkdir(parents=True)
    data = b"not really a wheel, but bytes with a digest"
    (context / "feature_store_py-1.0-py3-none-any.whl").write_bytes(data)
    return "wheels/feature_store_py-1.0-py3-none-any.whl", hashlib.sha256(data).hexdigest()


def test_a_wheel_with_its_sha256_is_installed(tmp_path):
    wheel, sha = _wheel(tmp_path)
    code, calls, _ = _run(tmp_path, wheel, sha)
    assert code == 0
    assert len(calls) == 1 and calls[0].startswith("install ")
    assert calls[0].endswith("feature_store_py-1.0-py3-none-any.whl")


def test_a_wheel_with_another_sha256_or_none_is_refused_and_not_installed(tmp_path):
    wheel, sha = _wheel(tmp_path)
    code, calls, _ = _run(tmp_path, wheel, "0" * 64)
    assert code != 0 and calls == []
    code, calls, text = _run(tmp_path, wheel, "")
    assert code == 1 and calls == [] and "FEATURESTORE_WHEEL_SHA256" in text
    assert sha not in text


def test_no_wheel_installs_nothing(tmp_path):
    code, calls, text = _run(tmp_path, "", "")
    assert code == 0 and calls == [] and "no FeatureStore SDK" in text
