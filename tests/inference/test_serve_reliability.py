"""The server stays answerable when its engine cannot: a dead engine thread fails every waiting and running
request (503) and refuses new ones; a request waits at most ``max_queue_wait_s``; every 429 and 503 says when to
retry; a queued stream hears keep-alive comments; ``/health`` reports a stalled engine; a draft process that hangs
fails its call within ``draft_timeout_s``; shutdown answers the queue 503 before it drains connections, within a
bound; a prompt is tokenised off the event loop, an over-long one refused before it is tokenised; a failure's text
stays in the log (the client hears its type and an id); and a stream whose client leaves before its body starts
still leaves the engine and is counted."""

from __future__ import annotations

import asyncio
import functools
import importlib
import json
import logging
import re
import threading
import time

import httpx
import pytest
from serve_helpers import (
    http_client,
    Paced,
    error_of,
    metric,
    own_target,
    runner_of,
    serve_config,
    start,
    tiny_models,
    wait_for,
)

import inference.serve.app as serve_app
from core.errors import UserError
from inference.executors import make_executor
from inference.serve.server import build_server, uvicorn_config

BODY = {"model": "tiny", "prompt": [5, 6, 7], "temperature": 0}


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return tiny_models(tmp_path_factory.mktemp("serve_reliability"))


def post_in_thread(url: str, body: dict, into: dict, key: str) -> threading.Thread:
    thread = threading.Thread(target=lambda: into.update({key: http_client.post(url, json=body, timeout=5)}))
    thread.start()
    return thread


class EngineDeath(BaseException):
    """Not an Exception: nothing in the engine's per-request handling catches it, so it ends the worker's loop."""


def test_a_dead_engine_fails_its_requests_and_refuses_new_ones(tiny, monkeypatch):
    gate = threading.Event()
    with start(tiny, "batch_size=1") as server:
        algorithm = server.server.model.algorithm

        def dying_generate(*args, **kwargs):
            gate.wait(5)
            raise EngineDeath("the worker's loop is gone")

        monkeypatch.setattr(algorithm, "generate", dying_generate)
        url, answers = f"{server.url}/v1/completions", {}
        running = post_in_thread(url, {**BODY, "max_tokens": 4}, answers, "running")
        wait_for(lambda: metric(server, "spectrain_running") == 1, timeout=5)
        queued = post_in_thread(url, {**BODY, "max_tokens": 4}, answers, "queued")
        wait_for(lambda: metric(server, "spectrain_queue_depth") == 1, timeout=5)
        gate.set()
        running.join(10)
        queued.join(10)
        for key in ("running", "queued"):
            assert answers[key].status_code == 503 and answers[key].headers["retry-after"].isdigit()
            message = error_of(answers[key])["message"]
            assert "EngineDeath" in message and "loop is gone" not in message and "incident-" in message
        later = http_client.post(url, json={**BODY, "max_tokens": 4}, timeout=5)
        assert later.status_code == 503 and "engine stopped" in error_of(later)["message"]
        health = http_client.get(f"{server.url}/health", timeout=5)
        assert health.status_code == 503 and "EngineDeath" in health.json()["status"]


def test_a_request_waits_at_most_max_queue_wait_s_and_every_refusal_says_when_to_retry(tiny, monkeypatch):
    """One request at a time, held at its first forward: a second one waits 1.5 s and is answered 503, a third
    finds the queue full (429); both say Retry-After. A queued stream hears keep-alive comments, then its error."""
    monkeypatch.setattr(serve_app, "KEEPALIVE_S", 0.05)
    gate = threading.Event()
    with start(tiny, "batch_size=1", "max_queue=1", "max_queue_wait_s=1.5") as server, Paced(runner_of(server), gate):
        url, answers = f"{server.url}/v1/completions", {}
        with http_client.stream("POST", url, json={**BODY, "max_tokens": 50, "stream": True}, timeout=5):
            wait_for(lambda: metric(server, "spectrain_running") == 1, timeout=5)
            started = time.monotonic()
            waiting = post_in_thread(url, {**BODY, "max_tokens": 4}, answers, "waiting")
            wait_for(lambda: metric(server, "spectrain_queue_depth") == 1, timeout=5)
            full = http_client.post(url, json={**BODY, "max_tokens": 4}, timeout=5)
            assert full.status_code == 429 and int(full.headers["retry-after"]) >= 1
            waiting.join(5)
            assert time.monotonic() - started < 5
            answer = answers["waiting"]
            assert answer.status_code == 503 and int(answer.headers["retry-after"]) >= 1
            assert error_of(answer)["code"] == "queue_timeout"
            with http_client.stream("POST", url, json={**BODY, "max_tokens": 4, "stream": True}, timeout=5) as queued:
                lines = [line for line in queued.iter_lines() if line]
        assert lines[0] == ": keep-alive" and lines[-1] == "data: [DONE]"
        assert "queue" in lines[-2] and "max_queue_wait_s" in lines[-2]
        gate.set()
        assert http_client.post(url, json={**BODY, "max_tokens": 3}, timeout=5).status_code == 200


def test_health_reports_an_engine_that_makes_no_progress(tiny):
    gate = threading.Event()
    with start(tiny, "batch_size=1", "stall_s=0.2") as server, Paced(runner_of(server), gate):
        health = http_client.get(f"{server.url}/health", timeout=5)
        assert health.status_code == 200 and health.json()["last_progress_s"] >= 0
        answers = {}
        thread = post_in_thread(f"{server.url}/v1/completions", {**BODY, "max_tokens": 4}, answers, "held")
        wait_for(lambda: http_client.get(f"{server.url}/health").status_code == 503, timeout=5)
        stalled = http_client.get(f"{server.url}/health").json()
        assert "stalled" in stalled["status"] and stalled["last_progress_s"] >= 0.2
        gate.set()
        thread.join(5)
        assert answers["held"].status_code == 200
        assert http_client.get(f"{server.url}/health").status_code == 200


def test_a_draft_process_that_hangs_fails_its_call_within_the_timeout(tiny):
    """The draft side is the ``time`` module in a child process: ``call("sleep", 60)`` hangs it. The call fails
    after ``call_timeout_s``, the child is stopped and the executor marked broken (its owner starts a new one).
    The server passes its ``draft_timeout_s`` to the algorithm's executor."""
    with make_executor(
        "multiprocess", functools.partial(importlib.import_module, "time"), threads=1, call_timeout_s=1.0
    ) as executor:
        assert executor.call("gmtime", 0).tm_year == 1970
        started = time.monotonic()
        with pytest.raises(RuntimeError, match="did not answer within 1 s.*draft_timeout_s"):
            executor.call("sleep", 60)
        assert time.monotonic() - started < 5
        assert executor.broken
        executor.process.join(5)
        assert not executor.process.is_alive()
    server = build_server(
        serve_config(tiny, "algorithm=pearl", "executor=multiprocess", "draft_timeout_s=7", "warmup=false"),
        target=own_target(tiny),
    )
    try:
        assert server.model.algorithm.executor_kwargs["call_timeout_s"] == 7
    finally:
        server.close()


def test_shutdown_answers_the_queue_503_before_draining_and_within_a_bound(tiny):
    """What SIGTERM does (uvicorn's should_exit), with a request generating and one waiting: both are answered
    503 at once instead of being served (or cut off) while connections drain."""
    with start(tiny, "batch_size=1") as server, Paced(runner_of(server), delay=0.05):
        url, answers = f"{server.url}/v1/completions", {}
        running = post_in_thread(url, {**BODY, "max_tokens": 200}, answers, "running")
        wait_for(lambda: metric(server, "spectrain_running") == 1, timeout=5)
        queued = post_in_thread(url, {**BODY, "max_tokens": 200}, answers, "queued")
        wait_for(lambda: metric(server, "spectrain_queue_depth") == 1, timeout=5)
        started = time.monotonic()
        server.uvicorn.should_exit = True
        server.thread.join(10)
        assert time.monotonic() - started < 3 and not server.thread.is_alive()
        running.join(5)
        queued.join(5)
        for key in ("running", "queued"):
            assert answers[key].status_code == 503 and "shutting down" in error_of(answers[key])["message"]
    cfg = serve_config(tiny)
    assert cfg.shutdown_timeout_s > 0
    assert uvicorn_config(None, cfg.log_level, cfg.shutdown_timeout_s).timeout_graceful_shutdown == 10


class SlowTokenizer:
    """The served tokenizer, 1.2 s per encode, recording each text it encodes."""

    def __init__(self, tokenizer):
        self.tokenizer, self.encoded = tokenizer, []

    def __call__(self, text, *args, **kwargs):
        self.encoded.append(text)
        time.sleep(1.2)
        return self.tokenizer(text, *args, **kwargs)

    def __getattr__(self, name):
        return getattr(self.tokenizer, name)


async def post_in_process(app, path: str, body: dict) -> httpx.Response:
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://tiny") as http:
        return await http.post(path, json=body)


def test_tokenising_runs_off_the_event_loop_and_over_long_text_is_refused_before_it(tiny):
    server = build_server(serve_config(tiny, "warmup=false"), target=own_target(tiny))
    slow = server.model.tokenizer = SlowTokenizer(server.model.tokenizer)

    async def health_while_tokenising() -> tuple[float, int]:
        """The longest wait between /health answers while a completion's prompt is tokenised (1.2 s)."""
        transport = httpx.ASGITransport(app=server.app)
        async with httpx.AsyncClient(transport=transport, base_url="http://tiny", timeout=10) as http:
            completion = asyncio.ensure_future(
                http.post("/v1/completions", json={**BODY, "prompt": "Name a prime.", "max_tokens": 2})
            )
            gaps, last = [], time.monotonic()
            while not completion.done():
                await asyncio.sleep(0.01)  # the completion's turn (a /health answer need not suspend at all)
                await http.get("/health")
                gaps.append(time.monotonic() - last)
                last = time.monotonic()
            return max(gaps), (await completion).status_code

    try:
        longest_gap, status = asyncio.run(health_while_tokenising())
        assert status == 200 and slow.encoded == ["Name a prime."] and longest_gap < 0.6
        limit = server.model.max_prompt_chars
        assert limit >= server.model.max_seq_len
        slow.encoded.clear()
        long = asyncio.run(post_in_process(server.app, "/v1/completions", {**BODY, "prompt": "a" * (limit + 1)}))
        chat = asyncio.run(
            post_in_process(
                server.app,
                "/v1/chat/completions",
                {
                    "model": "tiny",
                    "messages": [
                        {"role": "user", "content": "a" * (limit // 2 + 1)},
                        {"role": "assistant", "content": "b"},
                        {"role": "user", "content": [{"type": "text", "text": "a" * (limit // 2 + 1)}]},
                    ],
                },
            )
        )
        assert slow.encoded == []
        for answer, param in ((long, "prompt"), (chat, "messages")):
            assert answer.status_code == 400
            assert error_of(answer)["code"] == "context_length_exceeded" and error_of(answer)["param"] == param
    finally:
        server.close()


def test_a_failure_tells_the_client_its_type_and_id_and_the_log_its_text(tiny, monkeypatch, caplog):
    """An engine failure (a bug) answers 500 with the exception's type and the answer's id, not its text (paths,
    shapes), which the log has under that id; a UserError's line, written for users, reaches them whole. A route
    that fails (outside the engine) answers the same way."""
    with start(tiny, "batch_size=1") as server, caplog.at_level(logging.ERROR):
        algorithm, url = server.server.model.algorithm, f"{server.url}/v1/completions"

        def failing(*args, **kwargs):
            raise RuntimeError("cannot read /srv/models/secret.bin: shape [3, 4] != [4, 3]")

        monkeypatch.setattr(algorithm, "generate", failing)
        for answer in (http_client.post(url, json={**BODY, "max_tokens": 3}, timeout=10), _stream_error(url)):
            message = answer if isinstance(answer, str) else error_of(answer)["message"]
            assert "RuntimeError" in message and "secret" not in message and "shape" not in message
            request_id = re.search(r"cmpl-[0-9a-f]+", message).group()
            assert any(request_id in r.getMessage() and "secret.bin" in str(r.exc_info[1]) for r in caplog.records)

        def refused(*args, **kwargs):
            raise UserError("max_new_tokens=3 leaves no room: lower it")

        monkeypatch.setattr(algorithm, "generate", refused)
        answer = http_client.post(url, json={**BODY, "max_tokens": 3}, timeout=10)
        assert answer.status_code == 500 and error_of(answer)["message"] == "max_new_tokens=3 leaves no room: lower it"

        def broken_route(*args, **kwargs):
            raise ValueError("template at /srv/templates/chat.jinja line 3")

        monkeypatch.setattr(serve_app, "_completion_prompt", broken_route)
        answer = http_client.post(url, json={**BODY, "max_tokens": 3}, timeout=10)
        message = error_of(answer)["message"]
        assert answer.status_code == 500 and "ValueError" in message and "/srv" not in message
        incident = re.search(r"incident-[0-9a-f]+", message).group()
        assert any(incident in r.getMessage() and "/srv/templates" in str(r.exc_info[1]) for r in caplog.records)


def _stream_error(url: str) -> str:
    """A streamed request's error event's message."""
    with http_client.stream("POST", url, json={**BODY, "max_tokens": 3, "stream": True}, timeout=10) as stream:
        events = [line for line in stream.iter_lines() if line.startswith("data: {")]
    return json.loads(events[-1][len("data: ") :])["error"]["message"]


def test_a_stream_whose_client_leaves_before_its_body_starts_leaves_the_engine_and_is_counted(tiny):
    """The client is gone when the response's headers go out (sending them fails), so the body never starts: the
    request must still be cancelled (it would generate all its tokens for nobody) and counted as 499."""

    async def leave_at_the_headers(app) -> None:
        body = b'{"model": "tiny", "prompt": [5, 6, 7], "temperature": 0, "max_tokens": 200, "stream": true}'
        scope = {
            "type": "http",
            "asgi": {"version": "3.0", "spec_version": "2.4"},
            "http_version": "1.1",
            "method": "POST",
            "scheme": "http",
            "path": "/v1/completions",
            "raw_path": b"/v1/completions",
            "query_string": b"",
            "root_path": "",
            "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())],
            "client": ("127.0.0.1", 1),
            "server": ("tiny", 80),
        }
        sent = []

        async def receive():
            if not sent:
                sent.append(True)
                return {"type": "http.request", "body": body, "more_body": False}
            await asyncio.sleep(3600)

        async def send(message):
            if message["type"] == "http.response.start":
                raise OSError("the client closed the connection")

        try:
            await app(scope, receive, send)
        except Exception:  # noqa: BLE001 - how the framework reports the lost client is not what this test checks
            pass

    gate = threading.Event()
    with start(tiny, "batch_size=1") as server, Paced(runner_of(server), gate) as paced:
        asyncio.run(leave_at_the_headers(server.server.app))
        wait_for(lambda: metric(server, "spectrain_requests_total", status="499") == 1, timeout=5)
        gate.set()
        wait_for(lambda: metric(server, "spectrain_running") == 0, timeout=5)
        assert metric(server, "spectrain_cancelled_total") == 1 and paced.calls < 20
