"""Both Dockerfiles are clean under hadolint, run as non-root, and pin what they install."""

import pathlib
import re
import subprocess
import sys

import pytest

from deltarec.orchestrate.images import TOOLS_IMAGE, TRAINER_IMAGE

IMAGES = pathlib.Path(__file__).resolve().parents[2] / "images"
HADOLINT = pathlib.Path(sys.executable).parent / "hadolint"


def hadolint(path):
    return subprocess.run(
        [str(HADOLINT), "--no-color", str(path)], capture_output=True, text=True, timeout=60
    )


@pytest.mark.parametrize("name", ["trainer", "tools"])
def test_dockerfile_is_clean_under_hadolint(name):
    result = hadolint(IMAGES / name / "Dockerfile")
    assert result.returncode == 0, result.stdout + result.stderr


def test_hadolint_does_flag_an_unpinned_root_image(tmp_path):
    bad = tmp_path / "Dockerfile"
    bad.write_text("FROM python\nRUN pip install kfp\n")
    result = hadolint(bad)
    assert result.returncode != 0 and "DL3006" in result.stdout and "DL3013" in result.stdout


@pytest.mark.parametrize("name, pinned", [("trainer", TRAINER_IMAGE), ("tools", TOOLS_IMAGE)])
def test_dockerfile_runs_as_non_root_and_its_tag_is_the_pinned_one(name, pinned):
    text = (IMAGES / name / "Dockerfile").read_text()
    assert re.search(r"^USER 10001$", text, re.M)
    assert f"-t {pinned} ." in text  # the build command documented in the file
    assert "kfp==2.17.3" in text  # the version the compiled components expect
    for line in re.findall(r"^\s+([a-z][\w.\-\[\]\"]*)\s*\\?$", text, re.M):
        pytest.fail(f"unpinned package line in {name}/Dockerfile: {line!r}")
