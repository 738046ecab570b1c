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
    for line in re.findall(r"^\s+([a-z][\w.\-\[\]\"]*)\s*\\?$", text, re.M):
        pytest.fail(f"unpinned package line in {name}/Dockerfile: {line!r}")


def _requirements():
    lines = (IMAGES / "requirements.txt").read_text().splitlines()
    return [line for line in lines if line.strip() and not line.startswith("#")]


def test_the_shared_requirements_pin_every_package_kfp_to_the_components_version():
    requirements = _requirements()
    assert "kfp==2.17.3" in requirements  # the version the compiled components expect
    assert "alibabacloud-credentials==1.0.12" in requirements  # the credentials chain
    for line in requirements:
        assert re.fullmatch(r"[a-z][\w.\-]*(\[[\w,]+\])?==[\w.]+", line), f"not pinned: {line!r}"


@pytest.mark.parametrize("name", ["trainer", "tools"])
def test_both_images_install_the_shared_requirements_and_name_none_of_them_again(name):
    text = (IMAGES / name / "Dockerfile").read_text()
    assert "COPY images/requirements.txt /usr/share/deltarec/requirements.txt" in text
    install = text.index("-r /usr/share/deltarec/requirements.txt")
    assert text.index("COPY images/requirements.txt") < install < text.index("/wheels/deltarec-")
    for line in _requirements():
        assert line.split("==")[0].split("[")[0] + "==" not in text, f"{name} pins {line} again"


def _from_lines(text):
    return re.findall(r"^FROM (\S+)", text, re.M)


@pytest.mark.parametrize("name", ["trainer", "tools"])
def test_base_image_is_a_build_argument_defaulting_to_the_pinned_upstream_image(name):
    text = (IMAGES / name / "Dockerfile").read_text()
    assert "ARG BASE_IMAGE=python:3.11.11-slim-bookworm" in text
    assert _from_lines(text)[0] == "${BASE_IMAGE}"
    for image in _from_lines(text):
        assert image.startswith("${") or image.startswith("runtime-"), image


def test_trainer_variants_share_everything_but_the_base_and_the_torch_stack():
    text = (IMAGES / "trainer" / "Dockerfile").read_text()
    assert "ARG VARIANT=cuda" in text
    assert "ARG CUDA_IMAGE=nvidia/cuda:12.8.1-cudnn-runtime-ubuntu24.04" in text
    assert _from_lines(text) == [
        "${BASE_IMAGE}",
        "${CUDA_IMAGE}",
        "${BASE_IMAGE}",
        "runtime-${VARIANT}",
    ]
    assert "torch==2.13.0 fbgemm-gpu==1.8.0" in text  # cuda, from the cu128 index
    assert "fbgemm-gpu-cpu==1.8.0" in text and "--no-deps torchrec==1.8.0" in text
    assert "https://download.pytorch.org/whl/cu128" in text
    assert "https://download.pytorch.org/whl/cpu" in text


@pytest.mark.parametrize("name", ["trainer", "tools"])
def test_build_environment_enters_as_secrets_and_arguments_that_default_to_nothing(name):
    text = (IMAGES / name / "Dockerfile").read_text()
    runs = re.findall(r"^RUN (?:.*\\\n)*.*$", text, re.M)
    pip_runs = [r for r in runs if "pip install" in r or "pip wheel" in r]
    assert pip_runs
    for run in pip_runs:
        if "/wheels/deltarec-" in run:
            continue  # installs the wheel built in the first stage, no index needed
        assert "--mount=type=secret,id=pip.conf,target=/etc/pip.conf" in run, run
        assert "--mount=type=secret,id=ca-bundle" in run, run
    env_blocks = " ".join(re.findall(r"^ENV (?:.*\\\n)*.*$", text, re.M))
    assert "PIP_INDEX" not in env_blocks and "CERT" not in env_blocks.upper()
    assert not re.search(r"^COPY .*(pip\.conf|\.crt|\.pem)", text, re.M)
    assert 'ARG FEATURESTORE_WHEEL=""' in text


@pytest.mark.parametrize("name", ["trainer", "tools"])
def test_both_images_install_the_featurestore_wheel_last(name):
    text = (IMAGES / name / "Dockerfile").read_text()
    # the SDK's layer is the last RUN: builds with and without it share every other layer
    last_run = text.rindex("\nRUN ")
    assert text.index("ARG FEATURESTORE_WHEEL") < last_run
    assert "${FEATURESTORE_WHEEL}" in text[last_run:]
