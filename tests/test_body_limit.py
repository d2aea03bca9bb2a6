"""Oversized bodies get a clean 413 on every client, even one that finishes uploading before it reads.

urllib and a raw socket send the whole body first; if the server closed with body bytes unread, the
kernel would answer with RST and they would see `Connection reset by peer` instead of the 413.
"""
import json
import socket
import threading
import time
import urllib.error
import urllib.request
from urllib.parse import urlsplit

import pytest

BIG = 10 * 2**20
PIECE = 64 * 1024


def big_body(model: str) -> bytes:
    return b'{"model": "' + model.encode() + b'", "prompt": "' + b"a" * BIG + b'"}'


def pieces(body: bytes):
    return (body[i:i + PIECE] for i in range(0, len(body), PIECE))


def assert_413(body: bytes) -> None:
    assert json.loads(body)["error"]["code"] == "request_too_large", body[:300]


def urllib_413(base: str, model: str) -> None:
    req = urllib.request.Request(f"{base}/v1/completions", data=big_body(model), method="POST",
                                 headers={"Content-Type": "application/json"})
    with pytest.raises(urllib.error.HTTPError) as info:
        urllib.request.urlopen(req, timeout=30)
    assert info.value.code == 413
    assert_413(info.value.read())


def raw_request(base: str, head: str, chunks) -> tuple[str, dict[str, str], bytes, socket.socket]:
    """Sends everything first, then reads one response (Content-Length framed); returns the open socket too."""
    url = urlsplit(base)
    s = socket.create_connection((url.hostname, url.port), timeout=30)
    s.sendall(f"{head}Host: {url.hostname}:{url.port}\r\n\r\n".encode())
    for chunk in chunks:
        s.sendall(chunk)
    return (*read_response(s), s)


def read_response(s: socket.socket) -> tuple[str, dict[str, str], bytes]:
    buf = b""
    while b"\r\n\r\n" not in buf:
        data = s.recv(65536)
        assert data, f"connection closed before a response: {buf!r}"
        buf += data
    head, body = buf.split(b"\r\n\r\n", 1)
    status, *lines = head.decode("latin-1").split("\r\n")
    headers = {k.strip().lower(): v.strip() for k, v in (line.split(":", 1) for line in lines)}
    while len(body) < int(headers["content-length"]):
        data = s.recv(65536)
        assert data, f"connection closed mid-response: {body!r}"
        body += data
    return status, headers, body


def post_head(extra: str) -> str:
    return f"POST /v1/completions HTTP/1.1\r\nContent-Type: application/json\r\n{extra}"


def check_raw_content_length(base: str, model: str) -> None:
    body = big_body(model)
    # Like urllib: "Connection: close" makes the server close right after its response.
    status, _, resp, s = raw_request(base, post_head(f"Content-Length: {len(body)}\r\nConnection: close\r\n"),
                                     pieces(body))
    with s:
        assert status.startswith("HTTP/1.1 413"), status
        assert_413(resp)


def check_raw_chunked(base: str, model: str) -> None:
    chunks = [b"%x\r\n" % len(p) + p + b"\r\n" for p in pieces(big_body(model))] + [b"0\r\n\r\n"]
    status, _, resp, s = raw_request(base, post_head("Transfer-Encoding: chunked\r\n"), chunks)
    with s:
        assert status.startswith("HTTP/1.1 413"), status
        assert_413(resp)
        # The whole body was read and discarded, so the connection still serves the next request.
        s.sendall(f"GET /v1/models HTTP/1.1\r\nHost: {urlsplit(base).netloc}\r\n\r\n".encode())
        status, _, resp = read_response(s)
        assert status.startswith("HTTP/1.1 200"), (status, resp)


def timed(check, *args, budget: float = 30.0) -> None:
    start = time.monotonic()
    check(*args)
    assert time.monotonic() - start < budget


# -- the real stack: Ray Serve's proxy forwards the body to the ingress replica (limit 1 MiB) --

def test_urllib_gets_413_over_serve(serve_url):
    for _ in range(3):
        timed(urllib_413, serve_url, "tiny-gqa")


def test_raw_socket_content_length_gets_413_over_serve(serve_url):
    timed(check_raw_content_length, serve_url, "tiny-gqa")


def test_raw_socket_chunked_gets_413_over_serve(serve_url):
    timed(check_raw_chunked, serve_url, "tiny-gqa")


# -- in-process uvicorn, no Ray --

@pytest.fixture(scope="module")
def uvicorn_url(tiny_checkpoints):
    import uvicorn

    from loadtests.servers import free_port
    from server.engine import EngineConfig
    from server.http_app import create_app
    from server.model_client import LocalModelClient
    from server.openai_api import ApiLimits, OpenAIApi
    from server.worker import ModelWorker

    worker = ModelWorker("tiny", EngineConfig(model=str(tiny_checkpoints["llama"]), dtype="float32", num_blocks=64,
                                              block_size=4, max_model_len=256, enforce_eager=True))
    api = OpenAIApi({"tiny": LocalModelClient(worker)}, ApiLimits(max_n=4, max_tokens=200, max_body_bytes=2**20))
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(create_app(api), host="127.0.0.1", port=port, lifespan="off",
                                           log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        assert time.monotonic() < deadline and thread.is_alive(), "uvicorn did not start"
        time.sleep(0.05)
    yield f"http://127.0.0.1:{port}"
    server.should_exit = True
    thread.join(timeout=10)
    worker.shutdown()


def test_urllib_gets_413_in_process(uvicorn_url):
    for _ in range(3):
        timed(urllib_413, uvicorn_url, "tiny")


def test_raw_socket_gets_413_in_process(uvicorn_url):
    timed(check_raw_content_length, uvicorn_url, "tiny")
    timed(check_raw_chunked, uvicorn_url, "tiny")


@pytest.mark.parametrize("cap,value,sent", [("LINGER_MAX_SECONDS", 0.5, PIECE), ("LINGER_MAX_BYTES", 4 * PIECE, 2**20)])
def test_drain_gives_up_at_its_caps(uvicorn_url, monkeypatch, cap, value, sent):
    """A client that stalls (slow loris) or uploads past the cap loses its connection, not the server a task."""
    import server.http_app

    monkeypatch.setattr(server.http_app, cap, value)
    status, _, resp, s = raw_request(uvicorn_url, post_head(f"Content-Length: {BIG}\r\nConnection: close\r\n"),
                                     [b"a" * sent])
    with s:
        assert status.startswith("HTTP/1.1 413"), status
        assert_413(resp)
        s.settimeout(10)  # without the cap the server would wait for the rest of the body: recv times out
        try:
            assert s.recv(65536) == b""
        except ConnectionResetError:
            pass
