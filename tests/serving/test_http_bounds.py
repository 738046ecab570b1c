"""The replica's HTTP bounds: every malformed or oversize request is a clear 4xx, checked first."""

from __future__ import annotations

import asyncio
import http.client
import json
import socket
import time

import numpy as np
import pytest

from deltarec.errors import BadInputError, ConfigError
from deltarec.serving.api import STATUS_ERROR, public_status
from deltarec.serving.asgi import Budget, Refused
from deltarec.serving.follow import FixedPointer, Follower
from deltarec.serving.http import ReplicaServer
from deltarec.serving.limits import ServeLimits
from deltarec.serving.replica import Replica
from deltarec.stores import open_store
from deltarec.stores.replica.status import TOKEN_ENV, TOKEN_FILE_ENV, token_from_env
from deltarec.stores.types import ServingPointer

from .conftest import RUN, T_EMB, T_ZCH

# T_EMB is dim 8 float32: 41 answer bytes a key in /v1/rows (399 keys in 16 KiB), 208 in
# /v1/lookup (78 ids).
LIMITS = ServeLimits(
    max_keys=1024,
    max_ids=256,
    max_answer_bytes=16 << 10,
    max_inflight_bytes=1 << 20,
    max_head_bytes=2048,
    header_timeout_s=0.5,
    request_timeout_s=0.5,
    queue_timeout_s=0.5,
    keepalive_s=1.0,
)
TOKEN = "t0ken-for-the-replica-tests"


def _server(outbox, **kw) -> ReplicaServer:
    g = outbox.first_generation()
    follower = Follower(Replica(outbox.root, RUN), FixedPointer(ServingPointer(RUN, g, 1, 1.0)))
    follower.poll()
    return ReplicaServer(follower, limits=LIMITS, **kw)


@pytest.fixture
def served(outbox):
    with _server(outbox) as server:
        yield server


def exchange(port: int, data: bytes, timeout: float = 5.0) -> tuple[int, dict, bytes]:
    """Send raw bytes, read one answer: (status, headers, body)."""
    with socket.create_connection(("127.0.0.1", port), timeout=timeout) as s:
        s.sendall(data)
        resp = http.client.HTTPResponse(s)
        resp.begin()
        return resp.status, {k.lower(): v for k, v in resp.getheaders()}, resp.read()


def post(port: int, path: str, body: bytes, headers: str = "") -> tuple[int, dict, bytes]:
    head = f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Length: {len(body)}\r\n{headers}\r\n"
    return exchange(port, head.encode() + body)


def get(port: int, path: str, headers: str = "") -> tuple[int, dict, bytes]:
    return exchange(port, f"GET {path} HTTP/1.1\r\nHost: x\r\n{headers}\r\n".encode())


def error(answer: tuple[int, dict, bytes]) -> tuple[int, str]:
    status, _, body = answer
    return status, json.loads(body)["error"]


@pytest.mark.parametrize(
    "body, says",
    [
        (b"{not json", "not JSON"),
        (b'{"table": "T", "ids": [Infinity]}', "Infinity is not a JSON number"),
        (b'{"table": "T", "ids": [NaN]}', "NaN is not a JSON number"),
        (b"[" * 3000 + b"]" * 3000, "nests too deeply"),
        (b'{"table": "T", "ids": [1.5]}', "an id is a float"),
        (b'{"table": "T", "ids": [true]}', "an id is a bool"),
        (b'{"table": "T", "ids": ["1"]}', "an id is a str"),
        (b'{"table": "T", "ids": [18446744073709551616]}', "outside int64"),
        (b'{"table": 3, "ids": []}', "got table a int"),
        (b'{"table": "T", "ids": {"a": 1}}', "ids a dict"),
        (b"[1, 2]", "got a JSON list"),
        (b"\xff\xfe\x00", "not JSON"),
    ],
)
def test_every_malformed_lookup_body_is_a_400_naming_the_problem(served, body, says):
    status, message = error(post(served.port, "/v1/lookup", body))
    assert status == 400 and says in message and '{"table"' in message


def test_a_lookup_over_the_answer_bound_is_413_naming_the_most_ids(served):
    ids = json.dumps({"table": T_EMB, "ids": list(range(79))}).encode()
    status, headers, body = post(served.port, "/v1/lookup", ids)
    assert status == 413 and headers["x-deltarec-max-keys"] == "78"
    assert "79 ids" in json.loads(body)["error"]
    ok = json.dumps({"table": T_EMB, "ids": list(range(78))}).encode()
    status, _, body = post(served.port, "/v1/lookup", ok)
    assert status == 200 and len(json.loads(body)["rows"]) == 78


def test_a_lookup_answers_the_same_rows_as_the_replica_in_json(served, outbox):
    ids = [3, 5, 999, 3]
    status, _, body = post(
        served.port, "/v1/lookup", json.dumps({"table": T_EMB, "ids": ids}).encode()
    )
    expected = served._app.follower.replica.lookup(T_EMB, np.array(ids)).numpy()
    answer = json.loads(body)
    assert status == 200 and answer["seq"] == 1
    np.testing.assert_array_equal(np.array(answer["rows"], np.float32), expected)
    status, _, body = post(
        served.port, "/v1/lookup", json.dumps({"table": T_ZCH, "ids": []}).encode()
    )
    assert status == 200 and json.loads(body)["rows"] == []


def test_a_binary_lookup_answers_float32_rows_and_allows_more_ids_than_json(served):
    ids = list(range(-5, 195))  # 200 ids: over the JSON bound (78), within max_ids (256)
    body = json.dumps({"table": T_EMB, "ids": ids}).encode()
    status, headers, answer = post(
        served.port, "/v1/lookup", body, "Accept: application/octet-stream\r\n"
    )
    assert status == 200 and (headers["x-deltarec-rows"], headers["x-deltarec-dim"]) == ("200", "8")
    rows = np.frombuffer(answer, "<f4").reshape(200, 8)
    expected = served._app.follower.replica.lookup(T_EMB, np.array(ids)).numpy()
    np.testing.assert_array_equal(rows, expected)
    too_many = json.dumps({"table": T_EMB, "ids": list(range(257))}).encode()
    status, headers, _ = post(
        served.port, "/v1/lookup", too_many, "Accept: application/octet-stream\r\n"
    )
    assert status == 413 and headers["x-deltarec-max-keys"] == "256"  # max_ids


def test_an_oversize_body_is_refused_by_its_declared_length_before_it_is_sent(served):
    head = b"POST /v1/lookup HTTP/1.1\r\nHost: x\r\nContent-Length: 400000000\r\n\r\n"
    status, headers, body = exchange(served.port, head)  # no body follows
    assert status == 413 and headers["connection"] == "close"
    blind = json.dumps({"table": T_EMB, "ids": list(range(300_000))}).encode()  # 2.3 MB, sent
    status, headers, body = post(served.port, "/v1/lookup", blind)  # read and dropped, not reset
    assert (
        status == 413
        and "connection" not in headers
        and "at most 6656" in json.loads(body)["error"]
    )
    keys = f"POST /v1/rows?table={T_EMB} HTTP/1.1\r\nHost: x\r\nContent-Length: 3200\r\n\r\n"
    status, headers, body = exchange(served.port, keys.encode())
    assert status == 413 and headers["x-deltarec-max-keys"] == "399"
    assert (
        "400 keys" not in json.loads(body)["error"] and "at most 399" in json.loads(body)["error"]
    )


def test_a_client_that_expects_100_continue_gets_the_refusal_instead_and_a_close(served):
    head = (
        f"POST /v1/rows?table={T_EMB} HTTP/1.1\r\nHost: x\r\nContent-Length: 8000\r\n"
        "Expect: 100-continue\r\n\r\n"
    )
    status, headers, body = exchange(served.port, head.encode())  # the body is never sent
    assert status == 413 and headers["connection"] == "close" and b"Continue" not in body


def test_a_chunked_body_is_refused_once_it_streams_past_the_bound(served):
    head = f"POST /v1/rows?table={T_EMB} HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n"
    chunk = b"%x\r\n%s\r\n" % (4096, b"\0" * 4096)
    status, _, body = exchange(served.port, head.encode() + chunk)  # 4096 > 399 keys
    assert status == 413 and "over 3192 bytes" in json.loads(body)["error"]


def test_rows_bodies_that_are_not_int64_keys_are_400(served):
    status, message = error(post(served.port, f"/v1/rows?table={T_EMB}", b"\0" * 12))
    assert status == 400 and "not int64 keys" in message
    status, message = error(post(served.port, "/v1/rows", b""))
    assert status == 400 and "table=" in message
    status, message = error(post(served.port, "/v1/rows?table=nope", b""))
    assert status == 404 and "nope" in message


@pytest.mark.parametrize(
    "query, status, says",
    [
        ("limit=-1", 400, "limit=-1 is outside"),
        ("limit=x", 400, "not an integer"),
        ("after=99999999999999999999", 400, "outside"),
        ("limit=100000000", 200, None),
        ("limit=0", 200, None),
    ],
)
def test_keys_limit_is_validated_and_capped(served, query, status, says):
    got, _, body = get(served.port, f"/v1/keys?table={T_EMB}&{query}")
    assert got == status
    if says:
        assert says in json.loads(body)["error"]
    else:
        held = len(served._app.follower.replica.current.table(T_EMB))
        expected = 0 if query == "limit=0" else min(held, LIMITS.max_keys)
        assert len(body) == 8 * expected


def test_a_half_sent_head_or_body_is_answered_408_and_closed(served):
    started = time.monotonic()
    status, message = error(exchange(served.port, b"GET /v1/status HTTP/1.1\r\nHost:"))
    assert status == 408 and "head did not arrive" in message
    half = f"POST /v1/rows?table={T_EMB} HTTP/1.1\r\nHost: x\r\nContent-Length: 80\r\n\r\n"
    status, message = error(exchange(served.port, half.encode() + b"\0" * 8))
    assert status == 408 and "not received within 0.5 s" in message
    assert time.monotonic() - started < 4.5  # not the 5 s socket timeout of the client


def test_a_client_that_does_not_read_its_answer_is_cut_off_and_its_bytes_freed(outbox):
    g = outbox.first_generation()
    follower = Follower(Replica(outbox.root, RUN), FixedPointer(ServingPointer(RUN, g, 1, 1.0)))
    follower.poll()
    with ReplicaServer(follower, limits=ServeLimits(request_timeout_s=0.5)) as server:
        n = 1 << 20  # 41 MiB of answer: more than the sockets' buffers hold
        body = b"\0" * (8 * n)
        with socket.socket() as s:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
            s.connect(("127.0.0.1", server.port))
            head = f"POST /v1/rows?table={T_EMB} HTTP/1.1\r\nHost: x\r\nContent-Length: {8 * n}\r\n"
            s.sendall(head.encode() + b"\r\n" + body)
            deadline = time.monotonic() + 10
            while server._app._budget.free < server.limits.max_inflight_bytes:
                assert time.monotonic() < deadline, "the answer's bytes were never freed"
                time.sleep(0.1)
            s.settimeout(10)
            received = 0
            while chunk := s.recv(1 << 20):
                received += len(chunk)
        assert received < 41 * n  # the connection closed before the whole answer
        assert get(server.port, "/healthz")[0] == 200


def test_an_endless_head_is_431(served):
    head = b"GET /v1/status HTTP/1.1\r\nHost: x\r\nX-Pad: " + b"a" * 4096 + b"\r\n\r\n"
    status, message = error(exchange(served.port, head))
    assert status == 431 and "2048 bytes" in message


def test_the_token_guards_v1_and_the_store_client_sends_it(outbox, monkeypatch):
    monkeypatch.delenv(TOKEN_ENV, raising=False)
    monkeypatch.delenv(TOKEN_FILE_ENV, raising=False)
    with _server(outbox, token=TOKEN) as server:
        status, headers, _ = get(server.port, "/v1/tables")
        assert status == 401 and headers["www-authenticate"].startswith("Bearer")
        assert get(server.port, "/v1/tables", "Authorization: Bearer wrong\r\n")[0] == 401
        assert get(server.port, "/v1/tables", f"Authorization: Bearer {TOKEN}\r\n")[0] == 200
        for open_path in ("/healthz", "/readyz", "/metrics"):
            assert get(server.port, open_path)[0] == 200
        with (
            open_store(server.url, run=RUN) as store,
            pytest.raises(BadInputError, match=TOKEN_ENV),
        ):
            store.read(T_EMB, np.array([1]))
        monkeypatch.setenv(TOKEN_ENV, TOKEN)
        with open_store(server.url, run=RUN) as store:
            assert store.read(T_EMB, np.array([1, 2])).found.all()


def test_the_store_client_splits_a_read_over_the_replicas_bound(served):
    keys = np.arange(-100, 900)  # 1000 keys, 399 per request; 50 held
    with open_store(served.url, run=RUN) as store:
        result = store.read(T_EMB, keys)
        assert len(result.found) == 1000 and result.found.sum() == 50
        assert result.found[100:150].all() and (result.versions[100:150] > 0).all()


def test_the_token_comes_from_the_environment_or_a_file_and_is_checked(tmp_path):
    assert token_from_env({}) is None
    assert token_from_env({TOKEN_ENV: TOKEN}) == TOKEN
    (tmp_path / "token").write_text(TOKEN + "\n")
    assert token_from_env({TOKEN_FILE_ENV: str(tmp_path / "token")}) == TOKEN
    with pytest.raises(ConfigError, match="not both"):
        token_from_env({TOKEN_ENV: TOKEN, TOKEN_FILE_ENV: str(tmp_path / "token")})
    with pytest.raises(ConfigError, match="16 to 4096") as e:
        token_from_env({TOKEN_ENV: "short secret"})
    assert "short secret" not in str(e.value)
    with pytest.raises(ConfigError, match="cannot read"):
        token_from_env({TOKEN_FILE_ENV: str(tmp_path / "missing")})


def test_status_answers_no_store_details():
    status = {
        "run": RUN,
        "error": 'connection to server at "db.internal", port 5432 failed for user "svc"',
        "blocked": "gap at s3://bucket/root/ctr/gen-1/dump-3/MANIFEST.json",
    }
    out = public_status(status)
    assert out["error"] == STATUS_ERROR and out["run"] == RUN
    assert out["blocked"] == "gap at s3://..." and status["blocked"].startswith("gap at s3://b")


def test_a_request_that_finds_no_room_in_flight_waits_then_gets_503_with_retry_after():
    async def run() -> tuple[int, dict, int]:
        budget = Budget(100)
        async with budget.hold(80, timeout=1.0):
            with pytest.raises(Refused) as e:
                async with budget.hold(30, timeout=0.05):
                    pass
            async with budget.hold(20, timeout=0.05):  # fits beside the first
                pass
        async with budget.hold(100, timeout=0.05):  # all of it once released
            pass
        return e.value.status, e.value.headers, budget.free

    status, headers, free = asyncio.run(run())
    assert status == 503 and headers == {"Retry-After": "1"} and free == 100


def test_limits_that_cannot_hold_one_request_are_refused():
    with pytest.raises(ConfigError, match="max_inflight_bytes"):
        ServeLimits(max_inflight_bytes=1 << 20)
    with pytest.raises(ConfigError, match="max_ids=0"):
        ServeLimits(max_ids=0)
