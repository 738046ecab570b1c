"""Build deltarec's container images with docker, podman or buildah (``make images``).

Run from anywhere with any Python 3.10+ (standard library only)::

    python3 images/build.py                       # both images, pinned upstream bases
    python3 images/build.py trainer --variant cpu # the CPU trainer
    python3 images/build.py --local-base --pip-config host tools

The tags come from ``src/deltarec/orchestrate/images.py`` (the one place they are named). What a
build needs from its environment enters only as build arguments and secrets, never as a layer
of the image:

* ``--pip-config FILE`` becomes the build secret ``pip.conf`` (mounted at ``/etc/pip.conf`` in
  each pip step); ``--pip-config host`` writes one from this machine's own ``pip config list``:
  its ``cert`` becomes the build secret ``ca-bundle``, and every local path it names
  (find-links, ``file://`` indexes, constraints) is served read-only on 127.0.0.1 while the
  images build and named by that URL (:class:`LocalFiles`).
* ``--local-base`` builds the base image here instead of pulling ``python:3.11-slim-bookworm``:
  a Debian bookworm root made by ``debootstrap --variant=minbase`` from the Debian mirror of this
  machine's apt sources (cached under ``~/.cache/deltarec/images``), imported ``FROM scratch``
  by ``images/base/Dockerfile``. Needs root and debootstrap.
* ``--featurestore-wheel`` passes ``FEATURESTORE_WHEEL`` (a URL or a path inside the repository).
"""

from __future__ import annotations

import argparse
import configparser
import functools
import hashlib
import http.server
import importlib.util
import os
import posixpath
import re
import shutil
import subprocess
import sys
import tempfile
import threading
import time
import urllib.parse
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
IMAGES_DIR = REPO / "images"
BASE_PACKAGES = ("python3", "python3-venv", "ca-certificates")
"""What the local base adds to debootstrap's minbase: the python image's equivalent."""
SUITE = "bookworm"
DEFAULT_CACHE = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "deltarec"


class BuildError(RuntimeError):
    """A build step failed or cannot run here; the message says which and why."""


def pinned_tags() -> dict[str, str]:
    """The tags named in ``deltarec.orchestrate.images`` (read without importing the package)."""
    sys.path.insert(0, str(REPO / "src"))
    try:
        spec = importlib.util.spec_from_file_location(
            "_deltarec_images", REPO / "src/deltarec/orchestrate/images.py"
        )
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
    finally:
        sys.path.remove(str(REPO / "src"))
    return {
        "tools": module.TOOLS_IMAGE,
        "trainer": module.TRAINER_IMAGE,
        "trainer-cpu": module.TRAINER_CPU_IMAGE,
    }


# ---- the builder --------------------------------------------------------------------------
@dataclass
class Builder:
    """One container tool and how to call it.

    Attributes:
        tool: ``docker``, ``podman`` or ``buildah``.
        global_args: options before the subcommand (``--root``, ``--storage-driver``).
    """

    tool: str
    global_args: list[str] = field(default_factory=list)

    def cmd(self, *args: str) -> list[str]:
        """The full command line of one call."""
        return [self.tool, *self.global_args, *args]

    def build_cmd(self) -> list[str]:
        """The build subcommand with the flags every build here uses."""
        if self.tool == "buildah":
            return self.cmd("bud", "--isolation", "chroot", "--layers")
        return self.cmd("build")

    def exists(self, image: str) -> bool:
        """Whether ``image`` is in the local store."""
        sub = ["inspect", "--type", "image"] if self.tool == "buildah" else ["image", "inspect"]
        return subprocess.run(self.cmd(*sub, image), capture_output=True).returncode == 0


def find_builder(name: str, global_args: Sequence[str] = ()) -> Builder:
    """The named builder, or with ``auto`` the first of docker (daemon up), podman, buildah."""
    names = ["docker", "podman", "buildah"] if name == "auto" else [name]
    for tool in names:
        if shutil.which(tool) is None:
            continue
        probe = ["docker", "info"]
        if (
            tool == "docker"
            and name == "auto"
            and subprocess.run(probe, capture_output=True).returncode
        ):
            continue  # a client without a daemon
        return Builder(tool, list(global_args))
    raise BuildError(
        f"no container builder found (tried {', '.join(names)}); install docker, podman or "
        "buildah (on Debian as root: make image-tools)"
    )


# ---- what a build needs from this machine ---------------------------------------------------
class LocalFiles:
    """Chosen local files and folders, served read-only on 127.0.0.1 while images build.

    A build cannot see the machine's disk, and a build volume would leave its mount point in
    the image; so local find-links folders, ``file://`` indexes and constraints files that the
    machine's pip configuration names are served over loopback HTTP instead (the build's steps
    share the host's network: buildah's chroot isolation, ``--network host`` for the others).
    Only paths under an added root are served; everything else is 404.
    """

    def __init__(self) -> None:
        self.roots: list[Path] = []
        roots = self.roots

        class Handler(http.server.SimpleHTTPRequestHandler):
            def send_head(self):  # type: ignore[no-untyped-def]
                wanted = Path(posixpath.normpath(urllib.parse.unquote(self.path.split("?")[0])))
                if not any(wanted == r or r in wanted.parents for r in roots):
                    self.send_error(404)
                    return None
                return super().send_head()

            def log_message(self, format: str, *args: object) -> None:
                pass

        handler = functools.partial(Handler, directory="/")
        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def url(self, path: Path, root: Path | None = None) -> str:
        """Serve ``root`` (default: ``path``) and return the URL of ``path``."""
        root = root or path
        if root not in self.roots:
            self.roots.append(root)
        slash = "/" if path.is_dir() else ""
        port = self.server.server_address[1]
        return f"http://127.0.0.1:{port}{urllib.parse.quote(str(path))}{slash}"

    def close(self) -> None:
        """Stop serving."""
        self.server.shutdown()
        self.server.server_close()


@dataclass
class BuildEnv:
    """Secrets for the pip steps of a build, and the local files served to them.

    Attributes:
        secrets: secret id -> host file.
        served: local paths served by a :class:`LocalFiles` (the build needs host networking).
    """

    secrets: dict[str, Path] = field(default_factory=dict)
    served: list[Path] = field(default_factory=list)

    def args(self, builder: Builder) -> list[str]:
        """The build options that carry this environment in."""
        out: list[str] = []
        for sid, src in sorted(self.secrets.items()):
            out += ["--secret", f"id={sid},src={src}"]
        if self.served and builder.tool != "buildah":
            out += ["--network", "host"]  # buildah's chroot isolation shares it already
        return out


_LIST_LINE = re.compile(r"^(?P<section>[^.]*)\.(?P<key>[^=]+)=(?P<value>.*)$")
_PATH_KEYS = ("find-links", "extra-index-url", "index-url", "constraint", "requirement")


def host_pip_env(workdir: Path, files: LocalFiles, python: str = sys.executable) -> BuildEnv:
    """A pip configuration for the build made from this machine's ``pip config list``.

    ``cert`` (the CA bundle pip uses here) becomes the secret ``ca-bundle``, referenced by the
    written configuration as ``/run/secrets/ca-bundle``; every local path (``/...`` or
    ``file://...``) named by find-links, the indexes or constraints is served by ``files`` and
    named by its loopback URL, so the same configuration resolves inside the build.
    """
    listed = subprocess.run(
        [python, "-m", "pip", "config", "list"], capture_output=True, text=True, check=True
    ).stdout
    return pip_env_from_listing(listed, workdir, files)


def pip_env_from_listing(listed: str, workdir: Path, files: LocalFiles) -> BuildEnv:
    """:func:`host_pip_env` from the text of ``pip config list`` (``:env:`` entries win)."""
    settings: dict[str, str] = {}
    for line in listed.splitlines():
        m = _LIST_LINE.match(line.strip())
        if m is None:
            continue
        value = m["value"].strip().strip("'\"")
        if m["section"] == ":env:" or m["key"] not in settings:
            settings[m["key"]] = value
    env = BuildEnv()
    cert = settings.pop("cert", None)
    if cert:
        env.secrets["ca-bundle"] = Path(cert)
        settings["cert"] = "/run/secrets/ca-bundle"
    settings.pop("client-cert", None)
    for key in _PATH_KEYS:
        items = []
        for item in settings.get(key, "").split():
            path = Path(item[len("file://") :] if item.startswith("file://") else item)
            if not (path.is_absolute() and path.exists()):
                items.append(item)  # a URL (or a missing path, which pip reports)
                continue
            # a file index links to files beside its simple/ folder: serve its parent
            root = path.parent if key.endswith("index-url") and path.name == "simple" else path
            items.append(files.url(path, root))
            if root not in env.served:
                env.served.append(root)
        if items:
            settings[key] = " ".join(items)
    conf = configparser.ConfigParser(interpolation=None)
    conf["global"] = settings
    out = workdir / "pip.conf"
    with out.open("w") as f:
        conf.write(f)
    env.secrets["pip.conf"] = out
    return env


def file_pip_env(pip_config: Path, ca_bundle: Path | None) -> BuildEnv:
    """A user's own pip configuration (and CA bundle) as build secrets."""
    env = BuildEnv(secrets={"pip.conf": pip_config})
    if ca_bundle is not None:
        env.secrets["ca-bundle"] = ca_bundle
    return env


# ---- the local Debian base ----------------------------------------------------------------
def debian_mirror(sources: Sequence[Path] = ()) -> str:
    """The first Debian mirror in this machine's apt sources that serves ``bookworm`` main."""
    files = list(sources) or [
        Path("/etc/apt/sources.list"),
        *sorted(Path("/etc/apt/sources.list.d").glob("*")),
    ]
    for f in files:
        if not f.is_file():
            continue
        text = f.read_text(errors="replace")
        for line in text.splitlines():  # one-line style: deb URI SUITE COMPONENTS
            parts = re.sub(r"\[[^]]*\]", " ", line.split("#", 1)[0]).split()  # no [options]
            if len(parts) >= 4 and parts[0] == "deb" and parts[2] == SUITE and "main" in parts[3:]:
                return parts[1]
        for stanza in re.split(r"\n\s*\n", text):  # deb822 style
            fields = dict(
                (k.strip(), v.strip())
                for k, _, v in (ln.partition(":") for ln in stanza.splitlines())
                if not k.startswith("#") and v
            )
            if (
                "deb" in fields.get("Types", "").split()
                and SUITE in fields.get("Suites", "").split()
                and "main" in fields.get("Components", "").split()
            ):
                return fields["URIs"].split()[0]
    raise BuildError(f"no Debian {SUITE} main mirror in {', '.join(map(str, files))}")


def base_rootfs(cache: Path, mirror: str) -> Path:
    """The cached ``debootstrap --variant=minbase`` root as a tar, made once per mirror."""
    key = hashlib.sha256(f"{SUITE} {mirror} {' '.join(BASE_PACKAGES)}".encode()).hexdigest()[:12]
    out = cache / f"{SUITE}-minbase-{key}" / "rootfs.tar"
    if out.exists():
        return out
    if shutil.which("debootstrap") is None:
        raise BuildError("--local-base needs debootstrap (on Debian as root: make image-tools)")
    if os.geteuid() != 0:
        raise BuildError("--local-base needs root (debootstrap creates device nodes and owners)")
    out.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=out.parent) as tmp:
        root = Path(tmp) / "root"
        print(f"debootstrap {SUITE} from {mirror} (cached in {out.parent})", flush=True)
        run(
            "debootstrap",
            "--variant=minbase",
            f"--include={','.join(BASE_PACKAGES)}",
            SUITE,
            str(root),
            mirror,
            quiet=True,
        )
        for junk in ("var/cache/apt/archives", "var/lib/apt/lists", "usr/share/doc"):
            for p in (root / junk).glob("*"):
                if p.is_file() or p.is_symlink():
                    p.unlink()
                elif p.is_dir() and p.name != "partial":
                    shutil.rmtree(p)
        for junk in ("usr/share/man", "usr/share/locale"):
            shutil.rmtree(root / junk, ignore_errors=True)
            (root / junk).mkdir()
        part = out.with_suffix(".part")
        run("tar", "-C", str(root), "--numeric-owner", "-cf", str(part), ".")
        part.rename(out)
    return out


def local_base(builder: Builder, cache: Path, mirror: str | None = None) -> str:
    """Build (once) the local base image from the cached root; returns its tag."""
    rootfs = base_rootfs(cache, mirror or debian_mirror())
    dockerfile = IMAGES_DIR / "base" / "Dockerfile"
    digest = hashlib.sha256(dockerfile.read_bytes() + rootfs.parent.name.encode()).hexdigest()
    tag = f"localhost/deltarec-base:{SUITE}-{digest[:12]}"
    if not builder.exists(tag):
        run(*builder.build_cmd(), "-f", str(dockerfile), "-t", tag, str(rootfs.parent))
    return tag


# ---- building -----------------------------------------------------------------------------
def run(*argv: str, quiet: bool = False) -> None:
    """Run one command, echoing it; raise BuildError naming it when it fails."""
    print("+ " + " ".join(argv), flush=True)
    started = time.monotonic()
    result = subprocess.run(argv, capture_output=quiet, text=True)
    print(f"  ({argv[0]}: {time.monotonic() - started:.0f} s)", flush=True)
    if result.returncode != 0:
        tail = (result.stdout or "")[-3000:] + (result.stderr or "")[-3000:] if quiet else ""
        raise BuildError(f"{argv[0]} failed with exit code {result.returncode}\n{tail}".strip())


def build_image(
    builder: Builder,
    name: str,
    *,
    variant: str = "cuda",
    base: str | None = None,
    env: BuildEnv | None = None,
    featurestore_wheel: str | None = None,
    featurestore_wheel_sha256: str | None = None,
    torch_index: str | None = None,
    tag: str | None = None,
) -> str:
    """Build ``images/<name>/Dockerfile`` from the repository root; returns the tag.

    Args:
        builder: the container tool.
        name: ``tools`` or ``trainer``.
        variant: the trainer's ``cuda`` or ``cpu`` variant (the tools image has none).
        base: ``BASE_IMAGE`` (default: the Dockerfile's pinned upstream image).
        env: the build's pip secrets and volumes.
        featurestore_wheel: ``FEATURESTORE_WHEEL``, a URL or a path inside the repository.
        featurestore_wheel_sha256: ``FEATURESTORE_WHEEL_SHA256``, the wheel's sha256 (required
            with a wheel: the build installs only that file).
        torch_index: ``TORCH_INDEX`` (trainer; ``default`` = the pip configuration's index).
        tag: the tag (default: the pinned one; ``-cpu`` tag for the CPU trainer).
    """
    if name not in ("tools", "trainer"):
        raise BuildError(f"unknown image {name!r}: tools or trainer")
    if variant not in ("cuda", "cpu"):
        raise BuildError(f"unknown variant {variant!r}: cuda or cpu")
    tags = pinned_tags()
    tag = tag or (tags["trainer-cpu"] if name == "trainer" and variant == "cpu" else tags[name])
    args = [*builder.build_cmd(), "-f", str(IMAGES_DIR / name / "Dockerfile"), "-t", tag]
    if name == "trainer":
        args += ["--build-arg", f"VARIANT={variant}"]
        if torch_index:
            args += ["--build-arg", f"TORCH_INDEX={torch_index}"]
    if base:
        args += ["--build-arg", f"BASE_IMAGE={base}"]
    if featurestore_wheel:
        if not re.fullmatch(r"[0-9a-fA-F]{64}", featurestore_wheel_sha256 or ""):
            raise BuildError(
                "--featurestore-wheel needs --featurestore-wheel-sha256 (its sha256, 64 hex "
                "digits): the build installs only the file with that hash"
            )
        args += ["--build-arg", f"FEATURESTORE_WHEEL={featurestore_wheel}"]
        sha = (featurestore_wheel_sha256 or "").lower()
        args += ["--build-arg", f"FEATURESTORE_WHEEL_SHA256={sha}"]
    if env is not None:
        args += env.args(builder)
    started = time.monotonic()
    run(*args, str(REPO))
    print(f"built {tag} in {time.monotonic() - started:.0f} s", flush=True)
    return tag


def main(argv: Sequence[str] | None = None) -> int:
    """``make images``: build (and with ``--push`` push) the images named on the command line."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("images", nargs="*", default=["tools", "trainer"], help="tools, trainer")
    p.add_argument("--builder", default=os.environ.get("BUILDER", "auto"))
    p.add_argument("--variant", choices=["cuda", "cpu"], default="cuda", help="trainer variant")
    p.add_argument("--local-base", action="store_true", help="debootstrap base made here")
    p.add_argument("--pip-config", help="a pip.conf for the build, or 'host' for this machine's")
    p.add_argument("--ca-bundle", type=Path, help="CA bundle named by --pip-config FILE's cert")
    p.add_argument("--featurestore-wheel", help="FeatureStore SDK wheel: URL or repository path")
    p.add_argument("--featurestore-wheel-sha256", help="the FeatureStore SDK wheel's sha256")
    p.add_argument("--torch-index", help="TORCH_INDEX ('default': the pip configuration's)")
    p.add_argument("--storage-driver", help="podman/buildah storage driver (e.g. vfs)")
    p.add_argument("--storage-root", type=Path, help="podman/buildah image store (--root)")
    p.add_argument("--push", action="store_true", help="push the built tags")
    a = p.parse_args(argv)
    global_args = ["--storage-driver", a.storage_driver] if a.storage_driver else []
    if a.storage_root:
        global_args += ["--root", str(a.storage_root), "--runroot", str(a.storage_root / "run")]
    try:
        builder = find_builder(a.builder, global_args)
        print(f"building {', '.join(a.images)} with {builder.tool}", flush=True)
        files = LocalFiles()
        try:
            with tempfile.TemporaryDirectory() as tmp:
                env = None
                if a.pip_config == "host":
                    env = host_pip_env(Path(tmp), files)
                elif a.pip_config:
                    env = file_pip_env(Path(a.pip_config), a.ca_bundle)
                base = local_base(builder, DEFAULT_CACHE / "images") if a.local_base else None
                torch_index = a.torch_index
                for name in a.images:
                    tag = build_image(
                        builder,
                        name,
                        variant=a.variant,
                        base=base,
                        env=env,
                        featurestore_wheel=a.featurestore_wheel,
                        featurestore_wheel_sha256=a.featurestore_wheel_sha256,
                        torch_index=torch_index,
                    )
                    if a.push:
                        run(*builder.cmd("push", tag))
        finally:
            files.close()
    except BuildError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
