"""Server mode's requests retry as TRL 1.16's VLLMClient does: urllib3's Retry(total=5, connect=5, read=5, status=3,
status_forcelist=[500, 502, 503], backoff_factor=2, allowed_methods=["POST", "GET"]) mounted on its requests session
(trl/generation/vllm_client.py:224-237). Real HTTP against a tiny scripted server on localhost; the wait between tries
(vllm_server.sleep) is recorded instead of slept."""

from __future__ import annotations

import collections
import json
import socket
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from groupwise.generation import vllm_server
from groupwise.generation.vllm_server import VLLMServerClient, VLLMServerError

PROMPTS = [[5, 6], [7]]


class Server:
    """The endpoints the client calls. `script[path]`: what the next requests to `path` get, one item each — an HTTP
    status, (status, headers), "drop" (the connection closed unanswered) or ("slow", seconds) — before the answer;
    a str or int in place of a list repeats forever. `hits[path]` counts the requests that reached it."""

    def __init__(self, script: dict | None = None):
        self.script, self.hits = dict(script or {}), collections.Counter()
        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), self._handler())
        self.httpd.daemon_threads = True
        threading.Thread(target=self.httpd.serve_forever, args=(0.02,), daemon=True).start()
        self.url = "http://127.0.0.1:%d" % self.httpd.server_address[1]

    def close(self):
        self.httpd.shutdown()
        self.httpd.server_close()

    def next_fault(self, path):
        faults = self.script.get(path)
        if isinstance(faults, list):
            return faults.pop(0) if faults else None
        return faults

    @staticmethod
    def answer(path, body):
        if path == "/v1/models":
            return {"object": "list", "data": [{"id": "m"}]}
        if path == "/v1/completions":
            choice = {"token_ids": [1, 2], "logprobs": {"token_logprobs": [-0.5, -0.25]}}
            return {"choices": [{"prompt_token_ids": p, **choice} for p in body["prompt"] for _ in range(body["n"])]}
        return {}

    def _handler(self):
        server = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args):
                pass

            def _serve(self):
                length = int(self.headers.get("Content-Length") or 0)
                body = json.loads(self.rfile.read(length)) if length else None
                server.hits[self.path] += 1
                fault = server.next_fault(self.path)
                if fault == "drop":
                    self.close_connection = True
                    return
                if isinstance(fault, tuple) and fault[0] == "slow":
                    time.sleep(fault[1])
                    fault = None
                status, headers = fault if isinstance(fault, tuple) else (fault or 200, {})
                payload = json.dumps(server.answer(self.path, body) if status == 200 else
                                     {"object": "error", "message": f"scripted {status}", "code": status}).encode()
                self.send_response(status)
                headers = {"Content-Type": "application/json", "Content-Length": str(len(payload)), **headers}
                for k, v in headers.items():
                    self.send_header(k, v)
                try:
                    self.end_headers()
                    self.wfile.write(payload)
                except (BrokenPipeError, ConnectionResetError):  # a "slow" answer the client stopped waiting for
                    self.close_connection = True

            do_GET = do_POST = _serve

        return Handler


@pytest.fixture
def sleeps(monkeypatch):
    waits: list[float] = []
    monkeypatch.setattr(vllm_server, "sleep", waits.append)
    return waits


def _client(url, timeout=300.0):  # past the 60 s of waits the retries may take
    return VLLMServerClient(url, request_timeout=timeout)


def _generate(client):
    return client.generate(PROMPTS, n=2, max_tokens=2)


@pytest.mark.parametrize("status", [500, 502, 503])
def test_a_server_error_is_retried_then_the_answer_is_used(sleeps, status):
    server = Server({"/v1/completions": [status] * 3})
    try:
        out = _generate(_client(server.url))
    finally:
        server.close()
    assert server.hits["/v1/completions"] == 4  # status=3: three retries, the fourth try answers
    assert out["completion_ids"] == [[1, 2]] * 4 and out["logprobs"] == [[-0.5, -0.25]] * 4
    assert sleeps == [4.0, 8.0]  # urllib3's backoff with backoff_factor=2: none after the first failure, then 4, 8 s


def test_a_dropped_connection_is_retried_five_times(sleeps):
    server = Server({"/v1/models": ["drop"] * 2, "/v1/completions": ["drop"] * 5})
    try:
        client = _client(server.url)  # GET /v1/models, when the client connects: retried as well
        out = _generate(client)
    finally:
        server.close()
    assert client.model == "m" and server.hits["/v1/models"] == 3
    assert server.hits["/v1/completions"] == 6 and len(out["completion_ids"]) == 4  # total=5: the sixth try answers
    assert sleeps == [4.0] + [4.0, 8.0, 16.0, 32.0]


def test_a_server_that_keeps_failing_raises_after_four_tries_naming_url_tries_and_last_error(sleeps):
    server = Server({"/v1/completions": 503})
    try:
        client = _client(server.url)
        with pytest.raises(VLLMServerError) as e:
            _generate(client)
    finally:
        server.close()
    assert server.hits["/v1/completions"] == 4
    assert str(e.value).startswith(f"vLLM server: POST {server.url}/v1/completions failed after 4 tries: HTTP 503: ")
    assert "scripted 503" in str(e.value)
    assert sleeps == [4.0, 8.0]


def test_a_connection_that_keeps_breaking_raises_after_six_tries(sleeps):
    server = Server({"/reset_prefix_cache": "drop"})
    try:
        client = _client(server.url)
        with pytest.raises(ConnectionError) as e:
            client.reset_prefix_cache()
    finally:
        server.close()
    assert server.hits["/reset_prefix_cache"] == 6
    message = str(e.value)
    assert message.startswith(f"vLLM server: POST {server.url}/reset_prefix_cache failed after 6 tries: ")
    assert "RemoteDisconnected" in message and "is the vLLM server still running there?" in message
    assert sleeps == [4.0, 8.0, 16.0, 32.0]


def test_a_refused_connection_is_retried_then_raises_after_six_tries(sleeps):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        url = "http://127.0.0.1:%d" % s.getsockname()[1]  # nothing listens there once closed
    client = VLLMServerClient.__new__(VLLMServerClient)  # connected earlier; the server went away since
    client.base_url, client.request_timeout, client.model = url, 300.0, "m"
    with pytest.raises(ConnectionError, match=rf"^vLLM server: GET {url}/get_world_size failed after 6 tries: "
                                              r".*[Cc]onnection refused"):
        client.get_world_size()
    assert sleeps == [4.0, 8.0, 16.0, 32.0]


def test_retries_of_any_kind_stop_at_five(sleeps):
    """total=5 binds before status=3: three broken connections then 500s end after 6 tries, not 3 + 4."""
    server = Server({"/v1/completions": ["drop"] * 3 + [500] * 9})
    try:
        client = _client(server.url)
        with pytest.raises(VLLMServerError, match="failed after 6 tries: HTTP 500"):
            _generate(client)
    finally:
        server.close()
    assert server.hits["/v1/completions"] == 6


@pytest.mark.parametrize("status", [400, 404, 422, 429, 501, 504])
def test_an_answer_that_refuses_the_request_is_not_retried(sleeps, status):
    """Only 500/502/503 are in TRL's status_forcelist (429 only with Retry-After, below): a 503 is retried, the
    answer that follows it is final — 2 tries, and the error is that answer."""
    server = Server({"/v1/completions": [503, status]})
    try:
        client = _client(server.url)
        with pytest.raises(VLLMServerError, match=rf"failed after 2 tries: HTTP {status}: .*scripted {status}"):
            _generate(client)
    finally:
        server.close()
    assert server.hits["/v1/completions"] == 2 and sleeps == []


@pytest.mark.parametrize("status", [413, 429, 503])
def test_retry_after_is_waited_and_makes_413_and_429_retryable(sleeps, status):
    """urllib3's Retry.RETRY_AFTER_STATUS_CODES: with a Retry-After header these are retried, waiting what it says."""
    server = Server({"/v1/completions": [(status, {"Retry-After": "3"})] * 2 + [(status, {"Retry-After": "0"})]})
    try:
        out = _generate(_client(server.url))
    finally:
        server.close()
    assert server.hits["/v1/completions"] == 4 and len(out["completion_ids"]) == 4
    assert sleeps == [3.0, 3.0, 8.0]  # Retry-After: 0 falls back to the backoff (third failure: 8 s)


def test_the_retries_stay_within_the_request_timeout(sleeps):
    server = Server({"/v1/completions": 502})
    try:
        client = _client(server.url, timeout=1.0)
        with pytest.raises(VLLMServerError, match=r"failed after 2 tries \(retries stop at the request timeout, "
                                                  r"1 s\): HTTP 502"):
            _generate(client)  # the second failure would wait 4 s: past the timeout, so it stops there
    finally:
        server.close()
    assert server.hits["/v1/completions"] == 2 and sleeps == []


def test_a_server_that_never_answers_fails_at_the_request_timeout(sleeps):
    server = Server({"/v1/completions": [("slow", 1.5)]})
    try:
        client = _client(server.url, timeout=0.3)
        start = time.monotonic()
        with pytest.raises(ConnectionError, match=r"failed after 1 try \(retries stop at the request timeout, "
                                                  r"0.3 s\): .*timed out"):
            _generate(client)
        assert time.monotonic() - start < 1.0
    finally:
        server.close()
    assert sleeps == []
