"""``images/build.py`` (``make images``): what it passes to the builder, without building."""

from __future__ import annotations

import configparser
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from .conftest import build

LISTING = """\
:env:.cert='/etc/ssl/certs/ca-certificates.crt'
:env:.default-timeout='180'
:env:.find-links='{wheels}'
global.cert='/somewhere/else.pem'
global.constraint='{constraints}'
global.extra-index-url='file://{index}/simple file:///nonexistent/simple'
global.find-links='{wheels}'
"""


def _get(url):
    try:
        with urllib.request.urlopen(url, timeout=10) as r:
            return r.status, r.read()
    except urllib.error.HTTPError as e:
        return e.code, b""


def test_pip_listing_becomes_secrets_and_local_paths_are_served_on_loopback(tmp_path):
    wheels, index = tmp_path / "wheels", tmp_path / "pypi"
    (index / "simple" / "torch").mkdir(parents=True)
    (index / "simple" / "torch" / "index.html").write_text('<a href="../../files/t.whl">t</a>')
    (index / "files").mkdir()
    (index / "files" / "t.whl").write_bytes(b"wheel")
    wheels.mkdir()
    (wheels / "torch-2.13.0+cpu-cp311-cp311-manylinux_2_28_x86_64.whl").write_bytes(b"w")
    constraints = tmp_path / "constraints.txt"
    constraints.write_text("torch<=2.14.1\n")
    (tmp_path / "secret.txt").write_text("not served")
    listed = LISTING.format(wheels=wheels, index=index, constraints=constraints)
    files = build.LocalFiles()
    try:
        env = build.pip_env_from_listing(listed, tmp_path, files)
        assert env.secrets["ca-bundle"] == Path("/etc/ssl/certs/ca-certificates.crt")  # :env:
        conf = configparser.ConfigParser(interpolation=None)
        conf.read(env.secrets["pip.conf"])
        g = conf["global"]
        assert g["cert"] == "/run/secrets/ca-bundle" and g["default-timeout"] == "180"
        assert env.served == [wheels, index, constraints]
        assert g["find-links"] == f"http://127.0.0.1:{files.server.server_address[1]}{wheels}/"
        assert g["extra-index-url"].split()[1] == "file:///nonexistent/simple"  # left to pip

        # what pip will fetch: the find-links listing, the index page and the file it links to
        status, listing = _get(g["find-links"])
        assert status == 200 and b"torch-2.13.0%2Bcpu-cp311" in listing
        index_url = g["extra-index-url"].split()[0]
        status, page = _get(index_url + "torch/")
        assert status == 200 and b"../../files/t.whl" in page
        assert _get(index_url + "../files/t.whl") == (200, b"wheel")
        assert _get(g["constraint"]) == (200, b"torch<=2.14.1\n")
        # nothing outside the served roots
        base = index_url.split("/", 3)[:3]
        assert _get("/".join(base) + str(tmp_path / "secret.txt"))[0] == 404
        assert _get("/".join(base) + str(wheels) + "/../secret.txt")[0] == 404
    finally:
        files.close()

    assert f"id=pip.conf,src={env.secrets['pip.conf']}" in env.args(build.Builder("buildah"))
    assert "--network" not in env.args(build.Builder("buildah"))  # chroot shares the host's
    assert env.args(build.Builder("docker"))[-2:] == ["--network", "host"]


def test_debian_mirror_is_read_from_deb822_and_one_line_apt_sources(tmp_path):
    deb822 = tmp_path / "debian.sources"
    deb822.write_text(
        "Types: deb\nURIs: http://security.example/debian-security\n"
        "Suites: bookworm-security\nComponents: main\n\n"
        "Types: deb\n# a comment\nURIs: http://mirror.example/debian\n"
        "Suites: bookworm bookworm-updates\nComponents: main contrib\n"
    )
    assert build.debian_mirror([deb822]) == "http://mirror.example/debian"
    one_line = tmp_path / "sources.list"
    one_line.write_text(
        "deb-src http://x/debian bookworm main\ndeb [arch=amd64] http://y/debian bookworm main\n"
    )
    assert build.debian_mirror([one_line]) == "http://y/debian"
    with pytest.raises(build.BuildError, match="no Debian bookworm main mirror"):
        build.debian_mirror([tmp_path / "missing"])


def test_build_image_passes_the_pinned_tag_variant_base_and_wheel(monkeypatch):
    calls = []
    monkeypatch.setattr(build, "run", lambda *argv, quiet=False: calls.append(argv))
    builder = build.Builder("buildah", ["--storage-driver", "vfs"])
    sha = "ab" * 32
    tag = build.build_image(
        builder, "trainer", variant="cpu", base="localhost/b:1", featurestore_wheel="w.whl",
        featurestore_wheel_sha256=sha,
    )  # fmt: skip
    assert tag == build.pinned_tags()["trainer"] + "-cpu"
    argv = calls[0]
    assert argv[:6] == ("buildah", "--storage-driver", "vfs", "bud", "--isolation", "chroot")
    pairs = {argv[i + 1] for i, a in enumerate(argv) if a == "--build-arg"}
    assert pairs == {"VARIANT=cpu", "BASE_IMAGE=localhost/b:1", "FEATURESTORE_WHEEL=w.whl",
                     f"FEATURESTORE_WHEEL_SHA256={sha}"}  # fmt: skip
    assert argv[-1] == str(build.REPO) and str(build.IMAGES_DIR / "trainer/Dockerfile") in argv

    assert build.build_image(builder, "tools") == build.pinned_tags()["tools"]
    assert not [a for a in calls[1] if a.startswith("VARIANT")]
    with pytest.raises(build.BuildError, match="unknown variant 'rocm'"):
        build.build_image(builder, "trainer", variant="rocm")


def test_no_builder_found_names_what_to_install(monkeypatch):
    monkeypatch.setattr(build.shutil, "which", lambda tool: None)
    with pytest.raises(build.BuildError, match="install docker, podman or buildah"):
        build.find_builder("auto")


@pytest.mark.parametrize("sha", [None, "", "abc", "g" * 64])
def test_a_featurestore_wheel_without_its_sha256_is_refused_before_building(monkeypatch, sha):
    calls = []
    monkeypatch.setattr(build, "run", lambda *argv, quiet=False: calls.append(argv))
    with pytest.raises(build.BuildError, match="sha256"):
        build.build_image(build.Builder("buildah", []), "tools", featurestore_wheel="https://x/w.whl",
                          featurestore_wheel_sha256=sha)  # fmt: skip
    assert calls == []
