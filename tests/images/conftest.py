"""Build the images from this repository with buildah and run commands in them.

The images are built against a local base (``images/build.py --local-base``: a Debian bookworm
root from ``debootstrap --variant=minbase``, imported ``FROM scratch``) because public registries
cannot be reached here, with this machine's pip configuration passed in as build secrets (its
local wheel folders and indexes served on 127.0.0.1 while the images build). The debootstrap
root and buildah's store (layer cache) live under ``~/.cache/deltarec/images``, so a second
run reuses every unchanged layer.

Everything here skips, with the reason, where it cannot run: not root, buildah or debootstrap
missing (``make image-tools`` installs both with apt-get), or buildah unable to create a
container on any storage driver.
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from types import ModuleType

import pytest

REPO = Path(__file__).resolve().parents[2]
HOSTNAME = "deltarec-image-test"
MAX_STORE_BYTES = 20 * 2**30
"""A layer store past this size is emptied before building (old layers of changed sources)."""


def _load_build() -> ModuleType:
    spec = importlib.util.spec_from_file_location("deltarec_images_build", REPO / "images/build.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses resolve their module by name
    spec.loader.exec_module(module)
    return module


build = _load_build()


def _skip_reason() -> str | None:
    if sys.platform != "linux":
        return "container images are built on Linux only"
    if os.geteuid() != 0:
        return "building images here needs root (debootstrap, buildah's chroot isolation)"
    for tool in ("buildah", "debootstrap"):
        if shutil.which(tool) is None:
            return f"{tool} is not installed (as root on Debian, `make image-tools` installs it)"
    return None


def _store_bytes(root: Path) -> int:
    done = subprocess.run(["du", "-sb", str(root)], capture_output=True, text=True)
    return int(done.stdout.split()[0]) if done.returncode == 0 and done.stdout else 0


def _probe(driver: str, root: Path, runroot: Path) -> str | None:
    """None when buildah can create and mount a container with this driver, else the error."""
    args = ["buildah", "--storage-driver", driver, "--root", str(root), "--runroot", str(runroot)]
    made = subprocess.run([*args, "from", "scratch"], capture_output=True, text=True)
    if made.returncode != 0:
        return made.stderr.strip()[-500:]
    ctr = made.stdout.strip()
    mounted = subprocess.run([*args, "mount", ctr], capture_output=True, text=True)
    subprocess.run([*args, "rm", ctr], capture_output=True)
    return None if mounted.returncode == 0 else mounted.stderr.strip()[-500:]


@dataclass
class Images:
    """The builder the tests share and the base image made here.

    Attributes:
        builder: buildah with this session's store.
        base: the local base image's tag.
        env: the pip secrets of this machine's pip configuration (and the paths it serves).
        timings: what each build took, in seconds (printed at the end of the session).
    """

    builder: object
    base: str
    env: object
    timings: dict[str, float]
    pool: ThreadPoolExecutor = field(default_factory=lambda: ThreadPoolExecutor(2))
    started: dict[str, Future[str]] = field(default_factory=dict)

    def _build(self, name: str, kwargs: dict[str, object]) -> str:
        began = time.monotonic()
        tag = build.build_image(self.builder, name, base=self.base, env=self.env, **kwargs)
        self.timings[tag] = time.monotonic() - began
        return tag

    def start(self, key: str, name: str, **kwargs: object) -> None:
        """Start building ``images/<name>`` in the background (two builds overlap: the pip
        steps wait on the network as much as on the CPU)."""
        if key not in self.started:
            self.started[key] = self.pool.submit(self._build, name, kwargs)

    def build(self, name: str, key: str | None = None, **kwargs: object) -> str:
        """Build ``images/<name>`` from the repository (see ``images/build.py``); its tag."""
        key = key or name
        self.start(key, name, **kwargs)
        try:
            return self.started[key].result()
        except build.BuildError as e:
            pytest.fail(f"building images/{name} ({key}) failed: {e}")

    def run(
        self,
        image: str,
        argv: Sequence[str],
        volumes: Sequence[tuple[Path, str]] = (),
        timeout: float = 300,
    ) -> subprocess.CompletedProcess[str]:
        """Run ``argv`` in a fresh container of ``image`` as the image's user, then remove it."""
        # The container's hostname resolves, as under docker or Kubernetes (torchrun needs it).
        made = subprocess.run(
            self.builder.cmd("from", "--add-host", f"{HOSTNAME}:127.0.0.1", image),
            capture_output=True,
            text=True,
            check=True,
        )
        ctr = made.stdout.strip().splitlines()[-1]
        args = ["--isolation", "chroot", "--hostname", HOSTNAME]
        args += [a for host, at in volumes for a in ("-v", f"{host}:{at}")]
        try:
            return subprocess.run(
                self.builder.cmd("run", *args, ctr, "--", *argv),
                capture_output=True,
                text=True,
                timeout=timeout,
            )
        finally:
            subprocess.run(self.builder.cmd("rm", ctr), capture_output=True)

    def user(self, image: str) -> str:
        """The image's configured user."""
        return subprocess.run(
            self.builder.cmd("inspect", "--format", "{{.OCIv1.Config.User}}", image),
            capture_output=True,
            text=True,
            check=True,
        ).stdout.strip()


TRAINER_CPU = {"variant": "cpu", "torch_index": "default"}
"""The CPU trainer's build arguments here: torch from the pip configuration's index."""


@pytest.fixture(scope="session")
def images(request: pytest.FixtureRequest) -> Iterator[Images]:
    """The shared builder with the local base built (cached across runs).

    The images the collected tests need start building at once, side by side.
    """
    reason = _skip_reason()
    if reason:
        pytest.skip(reason)
    cache = build.DEFAULT_CACHE / "images"
    runroot = Path(tempfile.mkdtemp(prefix="deltarec-images-run-"))
    errors = {}
    for driver in ("overlay", "vfs"):  # overlay when the kernel allows it: vfs copies each layer
        root = cache / f"storage-{driver}"
        root.mkdir(parents=True, exist_ok=True)
        error = _probe(driver, root, runroot / driver)
        if error is None:
            break
        errors[driver] = error
    else:
        pytest.skip(f"buildah cannot create a container here: {errors}")
    if _store_bytes(root) > MAX_STORE_BYTES:
        shutil.rmtree(root, ignore_errors=True)
        root.mkdir(parents=True)
    builder = build.Builder(
        "buildah",
        ["--storage-driver", driver, "--root", str(root), "--runroot", str(runroot / driver)],
    )
    timings: dict[str, float] = {}
    files = build.LocalFiles()
    with tempfile.TemporaryDirectory() as tmp:
        env = build.host_pip_env(Path(tmp), files)
        started = time.monotonic()
        try:
            base = build.local_base(builder, cache)
        except build.BuildError as e:
            pytest.fail(f"the local base image could not be made: {e}")
        timings["local base"] = time.monotonic() - started
        images = Images(builder, base, env, timings)
        wanted = {f for item in request.session.items for f in getattr(item, "fixturenames", ())}
        if "trainer_cpu_image" in wanted:
            images.start("trainer-cpu", "trainer", **TRAINER_CPU)
        if "tools_image" in wanted:
            images.start("tools", "tools")
        yield images
        images.pool.shutdown(wait=True)
    files.close()
    print("\nimage build times: " + ", ".join(f"{k} {v:.0f} s" for k, v in timings.items()))
    shutil.rmtree(runroot, ignore_errors=True)


@pytest.fixture(scope="session")
def tools_image(images: Images) -> str:
    """``images/tools`` built from this repository, without the FeatureStore SDK."""
    return images.build("tools")


@pytest.fixture(scope="session")
def trainer_cpu_image(images: Images) -> str:
    """``images/trainer`` with ``VARIANT=cpu``; torch from the pip configuration's index here."""
    return images.build("trainer", key="trainer-cpu", **TRAINER_CPU)
