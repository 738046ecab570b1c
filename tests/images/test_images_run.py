"""The images built from this repository run the pipeline's steps for real.

``images/tools`` provisions, publishes and verifies a generation made on the host (artifacts
and a SQLite store mounted in) to PASS as its non-root user; ``images/trainer`` in its CPU
variant trains two ranks with delta dumps, and the tools image verifies what it published.
"""

from __future__ import annotations

import base64
import functools
import hashlib
import http.server
import json
import threading
import zipfile
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from deltarec.artifacts import ArtifactRoot
from deltarec.artifacts.types import DumpKind, TableSpec
from deltarec.stores import open_store
from deltarec.testing.dumps import new_generation, random_rows, write_dump

# Real builds and containers: out of `make test-fast`, like the tests that start servers. The
# first test to use an image waits for its build: cold (no cached layer) on a busy 2-core
# machine the local base and both images took 11 minutes; each container command has its own
# timeout below.
pytestmark = [pytest.mark.integration, pytest.mark.timeout(1500)]

T = "sparse.ebc.user_id"
TABLES = {T: TableSpec(dim=4, num_embeddings=100)}


@pytest.fixture
def data(tmp_path: Path) -> Path:
    """A folder mounted at /data, writable by the images' user (uid 10001)."""
    d = tmp_path / "data"
    d.mkdir()
    d.chmod(0o777)
    return d


def _writable_by_all(path: Path) -> None:
    for p in [path, *path.rglob("*")]:
        p.chmod(0o777 if p.is_dir() else 0o666)


def _ok(done, what: str) -> str:
    assert done.returncode == 0, f"{what}: exit {done.returncode}\n{done.stdout}\n{done.stderr}"
    return str(done.stdout)


def _steps(run: str, store: str) -> list[str]:
    return ["--artifacts", "/data/art", "--run", run, "--store", store]


def test_tools_image_runs_as_a_non_root_user(images, tools_image):
    assert images.user(tools_image) == "10001"
    out = _ok(images.run(tools_image, ["id", "-u"]), "id -u")
    assert out.strip() == "10001"


def test_images_carry_this_checkouts_deltarec_sources(images, tools_image, trainer_cpu_image):
    code = (
        "import hashlib, pathlib, deltarec; root = pathlib.Path(deltarec.__file__).parent; "
        "print(hashlib.sha256(b''.join(p.read_bytes() for p in sorted(root.rglob('*.py'))))"
        ".hexdigest())"
    )
    host = Path(__file__).resolve().parents[2] / "src" / "deltarec"
    want = hashlib.sha256(b"".join(p.read_bytes() for p in sorted(host.rglob("*.py"))))
    for image in (tools_image, trainer_cpu_image):
        out = _ok(images.run(image, ["python3", "-c", code]), f"sources in {image}")
        assert out.strip() == want.hexdigest(), f"{image} holds other deltarec sources"


def test_tools_image_holds_none_of_the_build_machine_settings(images, tools_image):
    """The pip configuration and CA bundle were secrets; the wheel folders were served."""
    probe = "import os, sys; print([p for p in sys.argv[1:] if os.path.exists(p)])"
    paths = ["/etc/pip.conf", "/run/secrets/ca-bundle", "/run/secrets/pip.conf"]
    paths += [str(p) for p in images.env.served]
    out = _ok(images.run(tools_image, ["python3", "-c", probe, *paths]), "probe")
    assert out.strip() == "[]"


def test_tools_image_provisions_publishes_and_verifies_a_host_generation_to_pass(
    images, tools_image, data
):
    root = ArtifactRoot(str(data / "art"))
    info = new_generation(root, "ctr", TABLES, world_size=2)
    snap = {T: {r: random_rows(range(r, 40, 2), TABLES[T], seed=r) for r in range(2)}}
    write_dump(root, info, 0, snap, kind=DumpKind.SNAPSHOT)
    delta = {T: {0: random_rows([4, 6], TABLES[T], seed=9), 1: random_rows([5], TABLES[T])}}
    write_dump(root, info, 1, delta)
    _writable_by_all(data)
    store = "sqlite:////data/store.db"
    mounts = [(data, "/data")]

    help_text = _ok(images.run(tools_image, ["deltarec", "--help"]), "deltarec --help")
    assert "provision" in help_text and "verify" in help_text
    _ok(images.run(tools_image, ["deltarec", "provision", *_steps("ctr", store)], mounts), "prov")
    published = images.run(
        tools_image, ["deltarec", "publish", *_steps("ctr", store), "--json"], mounts
    )
    assert json.loads(_ok(published, "publish"))["rows"] == 43
    verify = ["deltarec", "verify", *_steps("ctr", store), "--all", "--json", "/data/v.json"]
    done = images.run(tools_image, verify, mounts)
    _ok(done, "verify")
    doc = json.loads((data / "v.json").read_text())
    assert doc["passed"] is True, doc["failure"]
    assert doc["totals"]["MATCH"] == 40 and doc["totals"]["checked"] == 40

    # The rows the container wrote are the artifacts' rows, read back on the host.
    with open_store(f"sqlite:///{data / 'store.db'}") as s:
        got = s.read(T, np.array([4, 5, 7]))
    np.testing.assert_array_equal(got.embedding[0], delta[T][0].embedding[0])
    np.testing.assert_array_equal(got.embedding[1], delta[T][1].embedding[0])
    np.testing.assert_array_equal(got.embedding[2], snap[T][1].embedding[3])


def test_featurestore_url_in_an_image_without_the_sdk_fails_naming_the_sdk(
    images, tools_image, data
):
    root = ArtifactRoot(str(data / "art"))
    new_generation(root, "ctr", TABLES, world_size=1)
    _writable_by_all(data)
    url = "featurestore://proj/emb?region=cn-hangzhou"
    done = images.run(
        tools_image, ["deltarec", "provision", *_steps("ctr", url)], [(data, "/data")]
    )
    assert done.returncode == 2, done.stdout + done.stderr
    assert "feature_store_py" in done.stderr and "not installed" in done.stderr
    assert "Traceback" not in done.stderr


def _sdk_wheel(folder: Path) -> Path:
    """A wheel named like the FeatureStore SDK's, to check the build argument installs it.

    Only the installation is checked (the SDK is not on PyPI and cannot be fetched here); the
    backend's behaviour against the SDK surface is tested in tests/stores.
    """
    name, version = "feature_store_py", "0.0.0+imagetest"
    files = {
        f"{name}/__init__.py": f'__version__ = "{version}"\n',
        f"{name}-{version}.dist-info/METADATA": (
            f"Metadata-Version: 2.1\nName: feature-store-py\nVersion: {version}\n"
        ),
        f"{name}-{version}.dist-info/WHEEL": (
            "Wheel-Version: 1.0\nGenerator: deltarec-tests\nRoot-Is-Purelib: true\n"
            "Tag: py3-none-any\n"
        ),
    }
    record = []
    for path, text in files.items():
        digest = base64.urlsafe_b64encode(hashlib.sha256(text.encode()).digest()).rstrip(b"=")
        record.append(f"{path},sha256={digest.decode()},{len(text.encode())}")
    record.append(f"{name}-{version}.dist-info/RECORD,,")
    files[f"{name}-{version}.dist-info/RECORD"] = "\n".join(record) + "\n"
    wheel = folder / f"{name}-{version}-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w") as z:
        for path, text in files.items():
            z.writestr(path, text)
    return wheel


@pytest.fixture
def wheel_url(tmp_path: Path) -> Iterator[str]:
    """The SDK-named wheel served on 127.0.0.1, the way Alibaba Cloud serves the real one."""
    wheel = _sdk_wheel(tmp_path)
    handler = functools.partial(http.server.SimpleHTTPRequestHandler, directory=str(tmp_path))
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        sha = hashlib.sha256(wheel.read_bytes()).hexdigest()
        yield f"http://127.0.0.1:{server.server_address[1]}/{wheel.name}", sha
    finally:
        server.shutdown()
        server.server_close()


def test_featurestore_wheel_build_argument_installs_the_sdk_beside_the_credentials_chain(
    images, tools_image, wheel_url
):
    tag = "localhost/deltarec-tools-featurestore:test"
    url, sha = wheel_url
    images.build("tools", key="tools-featurestore", featurestore_wheel=url,
                 featurestore_wheel_sha256=sha, tag=tag)  # fmt: skip
    code = "import alibabacloud_credentials.client, feature_store_py as s; print(s.__version__)"
    out = _ok(images.run(tag, ["python3", "-c", code]), "import the SDK")
    assert out.strip() == "0.0.0+imagetest"
    assert images.user(tag) == "10001"


@pytest.mark.multiprocess
def test_trainer_cpu_image_trains_two_ranks_with_dumps_that_the_tools_image_verifies(
    images, trainer_cpu_image, tools_image, data
):
    assert images.user(trainer_cpu_image) == "10001"
    stack = (
        "import importlib.metadata as m, torch, fbgemm_gpu, torchrec; "
        "print(torch.__version__, m.version('fbgemm-gpu-cpu'), m.version('torchrec'), "
        "[d.metadata['Name'] for d in m.distributions() if d.metadata['Name'] == 'fbgemm-gpu'])"
    )
    out = _ok(images.run(trainer_cpu_image, ["python3", "-c", stack]), "torch stack")
    assert out.split() == ["2.13.0+cpu", "1.8.0", "1.8.0", "[]"]

    (data / "model.json").write_text(
        json.dumps({"zch": {"zch_size_per_rank": 16, "raw_id_space": 10000}})
    )
    store = "sqlite:////data/store.db"
    train = [
        "deltarec", "train", "--nproc-per-node", "2", "--device", "cpu", "--steps", "6",
        "--batch-size", "16", "--model-config", "/data/model.json", "--log-every", "3",
        "--dump-every-steps", "3", *_steps("demo", store),
    ]  # fmt: skip
    done = images.run(trainer_cpu_image, train, [(data, "/data")], timeout=400)
    _ok(done, "deltarec train")
    assert "step 6/6" in done.stderr

    manifests = sorted((data / "art").rglob("MANIFEST.json"))
    assert len(manifests) >= 3, manifests  # the snapshot and the dumps of steps 3 and 6
    verify = ["deltarec", "verify", *_steps("demo", store), "--all", "--json", "/data/v.json"]
    _ok(images.run(tools_image, verify, [(data, "/data")]), "verify in the tools image")
    doc = json.loads((data / "v.json").read_text())
    assert doc["passed"] is True, doc["failure"]
    assert doc["totals"]["MATCH"] > 0
