"""The local-mode proxy against a replica that drops connections: a real socket server stands in for the
engine (the fault is what is under test, not the engine)."""

from __future__ import annotations

import asyncio
import json
import socket
import struct
import threading

import httpx

from stallfree.local.proxy import build_app


class FakeReplica:
    """A real socket server on loopback that reads each whole request and hands it to `answer`."""

    def __init__(self) -> None:
        self.requests = 0
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self.sock.getsockname()[1]}"
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:  # closed
                return
            with conn:
                data = b""
                while b"\r\n\r\n" not in data:
                    data += conn.recv(65536)
                head, body = data.split(b"\r\n\r\n", 1)
                length = next(
                    (int(v) for k, _, v in (h.partition(b":") for h in head.split(b"\r\n")[1:])
                     if k.strip().lower() == b"content-length"), 0,
                )  # fmt: skip
                while len(body) < length:
                    body += conn.recv(65536)
                self.requests += 1
                self.answer(conn, body)

    def answer(self, conn: socket.socket, body: bytes) -> None:
        raise NotImplementedError

    def close(self) -> None:
        self.sock.close()


class DroppingReplica(FakeReplica):
    """Resets the connection for the first `drops` requests (the way an engine closing an idle keep-alive
    connection meets a request sent on it), then answers 200 with a JSON body."""

    def __init__(self, drops: int) -> None:
        self.drops = drops
        super().__init__()

    def answer(self, conn: socket.socket, body: bytes) -> None:
        if self.requests <= self.drops:
            conn.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))  # RST
            return
        out = json.dumps({"echo": json.loads(body)}).encode()
        conn.sendall(
            b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nConnection: close\r\n"
            b"Content-Length: %d\r\n\r\n%s" % (len(out), out)
        )


def post_through_proxy(replica: DroppingReplica) -> httpx.Response:
    app = build_app(lambda: [replica.url], dict, lambda: (b"", "text/plain"), None)

    async def run() -> httpx.Response:
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://proxy") as c:
            resp = await c.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2})
            await resp.aread()
            return resp

    try:
        return asyncio.run(run())
    finally:
        replica.close()


def test_a_connection_dropped_before_the_answer_is_retried_once():
    replica = DroppingReplica(drops=1)
    resp = post_through_proxy(replica)
    assert resp.status_code == 200, resp.text
    assert resp.json() == {"echo": {"prompt": "hi", "max_tokens": 2}}
    assert replica.requests == 2


def test_a_replica_that_keeps_dropping_gets_an_explicit_502():
    replica = DroppingReplica(drops=10)
    resp = post_through_proxy(replica)
    assert resp.status_code == 502
    error = resp.json()["error"]
    assert error["type"] == "bad_gateway" and "closed the connection before answering" in error["message"]
    assert replica.requests == 2


class ShortStreamReplica(FakeReplica):
    """Answers every request with a well-formed SSE body that stops before `data: [DONE]` (a replica whose
    stream was cut at an event boundary), then closes."""

    BODY = b'data: {"choices": [{"index": 0, "text": "Hel"}]}\n\ndata: {"choices": [{"index": 0, "text": "lo"}]}\n\n'

    def answer(self, conn: socket.socket, body: bytes) -> None:
        conn.sendall(
            b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nConnection: close\r\n"
            b"Content-Length: %d\r\n\r\n%s" % (len(self.BODY), self.BODY)
        )


def test_a_stream_that_ends_without_done_gets_an_error_event():
    replica = ShortStreamReplica()
    resp = post_through_proxy(replica)
    events = [line[6:] for line in resp.text.splitlines() if line.startswith("data: ")]
    assert [json.loads(e)["choices"][0]["text"] for e in events[:2]] == ["Hel", "lo"]  # relayed unchanged
    assert "before it was complete" in json.loads(events[2])["error"]["message"]
    assert events[3:] == ["[DONE]"]


class ResponsesStreamReplica(FakeReplica):
    """Answers with a /v1/responses SSE body: whole (it ends with response.completed, no [DONE]) or cut
    after a text delta."""

    HEAD = (b'event: response.created\ndata: {"type": "response.created", "sequence_number": 0}\n\n'
            b'event: response.output_text.delta\ndata: {"type": "response.output_text.delta", "delta": "Hi"}\n\n')  # fmt: skip
    END = b'event: response.completed\ndata: {"type": "response.completed", "sequence_number": 2}\n\n'

    def __init__(self, whole: bool) -> None:
        self.body = self.HEAD + (self.END if whole else b"")
        super().__init__()

    def answer(self, conn: socket.socket, body: bytes) -> None:
        conn.sendall(
            b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nConnection: close\r\n"
            b"Content-Length: %d\r\n\r\n%s" % (len(self.body), self.body)
        )


def test_a_whole_responses_stream_is_relayed_as_it_is_and_a_cut_one_gets_an_error_event():
    whole = ResponsesStreamReplica(whole=True)
    assert post_through_proxy(whole).content == whole.body  # its terminal event ends it: nothing added
    cut = post_through_proxy(ResponsesStreamReplica(whole=False)).text
    data = [line[6:] for line in cut.splitlines() if line.startswith("data: ")]
    assert "before it was complete" in json.loads(data[2])["error"]["message"] and data[3:] == ["[DONE]"]
