"""How a request and a server end: a cancelled non-streaming request stops generating at once, shutdown with work
in flight answers it (503) and returns within a bound, no two servers share a runner, closing collects the
adapter's last background update, and the metrics count each request once, by its outcome."""

from __future__ import annotations

import asyncio
import threading
import time

import httpx
import pytest
import torch
from serve_helpers import (
    http_client,
    ALGORITHMS,
    PROMPT,
    Paced,
    chat_ids,
    metric,
    own_target,
    runner_of,
    serve_config,
    start,
    submit,
    tiny_models,
    wait_for,
)

from inference.serve.scheduler import Finished
from inference.serve.server import build_server
from spectrain.adapt.background import changed_weights


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return tiny_models(tmp_path_factory.mktemp("serve_lifecycle"))


LONG = {"model": "tiny", "prompt": [5, 6, 7], "max_tokens": 200, "temperature": 0}


def test_a_non_streaming_request_whose_handler_is_cancelled_stops_generating(tiny):
    """The handler task itself cancelled (as uvicorn does at shutdown), not its client gone: the row is freed
    at once instead of generating its 200 tokens."""
    with start(tiny) as server, Paced(runner_of(server)) as paced:

        async def cancel_mid_answer() -> None:
            transport = httpx.ASGITransport(app=server.server.app)  # the app runs in this task
            async with httpx.AsyncClient(transport=transport, base_url="http://tiny") as http:
                task = asyncio.ensure_future(http.post("/v1/completions", json=LONG))
                while paced.calls < 3:
                    await asyncio.sleep(0.01)
                task.cancel()
                with pytest.raises(asyncio.CancelledError):
                    await task

        asyncio.run(cancel_mid_answer())
        wait_for(lambda: metric(server, "spectrain_running") == 0, timeout=5)
        assert paced.calls < 100 and metric(server, "spectrain_cancelled_total") == 1
        assert metric(server, "spectrain_requests_total", status="499") == 1


def test_shutdown_with_work_in_flight_answers_it_and_returns_within_a_bound(tiny):
    """One request at a time, 50 ms a forward: a non-streaming request generating, a stream and another request
    waiting. close() ends all three (503) and returns in well under the 10 s the running one still needed."""
    server = start(tiny, "batch_size=1")
    url, answers, streamed = f"{server.url}/v1/completions", {}, []
    with Paced(runner_of(server), delay=0.05) as paced:

        def stream() -> None:
            with http_client.stream("POST", url, json={**LONG, "stream": True}, timeout=30) as response:
                streamed.extend(line for line in response.iter_lines() if line.startswith("data:"))

        clients = [
            threading.Thread(target=lambda: answers.update(running=http_client.post(url, json=LONG, timeout=30))),
            threading.Thread(target=stream),
            threading.Thread(target=lambda: answers.update(queued=http_client.post(url, json=LONG, timeout=30))),
        ]
        for client in clients:
            client.start()
            time.sleep(0.2)
        wait_for(lambda: metric(server, "spectrain_queue_depth") == 2 and paced.calls >= 2)
        started = time.monotonic()
        server.close()
        closed_in = time.monotonic() - started
        for client in clients:
            client.join(30)
    assert closed_in < 3.0 and not server.server.scheduler.alive
    assert answers["running"].status_code == answers["queued"].status_code == 503
    assert "shutting down" in answers["running"].json()["error"]["message"]
    assert "shutting down" in streamed[-2] and streamed[-1] == "data: [DONE]"
    assert paced.calls < 60


def test_two_servers_never_share_a_runner(tiny):
    target, cfg = own_target(tiny), serve_config(tiny)
    first = build_server(cfg, target=target)
    with pytest.raises(ValueError, match="already serves another server"):
        build_server(cfg, target=target)
    first.close()
    build_server(cfg, target=target).close()  # free again once the first is closed


def test_closing_collects_the_adapters_last_background_update(tiny):
    """With ``adapt_background`` the update decided after the last query runs on the adapter's worker thread:
    closing the server waits for it and publishes it into the served drafter (and closes the decision log)."""
    forcing = [
        "adapt_prior=5",
        "adapt_min_gap=1",
        "adapt_cost_cache=null",
        "adapt_cost_rows=24",
        "adapt_head_lr=1e-2",
        "adapt_full_lr=1e-2",
        "adapt_validate=false",
        "adapt_background=true",
    ]
    with start(tiny, *ALGORITHMS["eagle3_tree"], "adapt=bandit", *forcing) as server:
        for content in ("Name a prime.", "Name a colour.", "Name a city.", "Name a tree."):
            response = http_client.post(
                f"{server.url}/v1/chat/completions",
                timeout=60,
                json={
                    "model": "tiny",
                    "messages": [{"role": "user", "content": content}],
                    "max_tokens": 12,
                    "temperature": 0,
                },
            )
            assert response.status_code == 200
        adapter = server.server.model.adapter.inner
        assert adapter.background.job is not None  # the last query's update, not collected while serving
    assert adapter.background.job is None and adapter.background.pool._shutdown
    assert changed_weights(adapter.log.rows[-1])  # the last update changed the weights ...
    assert all(torch.equal(training, served) for training, served in adapter.background.publisher.pairs)  # kept


def test_a_stream_is_counted_when_it_ends_by_its_outcome(tiny):
    gate = threading.Event()
    with start(tiny) as server, Paced(runner_of(server), gate):
        url = f"{server.url}/v1/chat/completions"
        body = {"model": "tiny", "messages": [{"role": "user", "content": PROMPT}], "temperature": 0, "stream": True}
        ok = {"endpoint": "/v1/chat/completions", "status": "200"}
        with http_client.stream("POST", url, json={**body, "max_tokens": 4}) as response:
            lines = (line for line in response.iter_lines() if line.startswith("data:"))
            assert '"role": "assistant"' in next(lines)  # the stream has begun; its outcome is not known yet
            assert metric(server, "spectrain_requests_total", **ok) == 0
            gate.set()
            assert list(lines)[-1] == "data: [DONE]"
        wait_for(lambda: metric(server, "spectrain_requests_total", **ok) == 1)
        with http_client.stream("POST", url, json={**body, "max_tokens": 200}) as response:  # dropped mid-answer
            next(line for line in response.iter_lines() if line.startswith("data:"))
        wait_for(lambda: metric(server, "spectrain_requests_total", status="499") == 1)
        assert metric(server, "spectrain_requests_total", **ok) == 1
        assert metric(server, "spectrain_cancelled_total") == 1


def test_a_finished_request_is_never_counted_as_cancelled(tiny):
    """A client that goes away after the engine finished its request (the end event not yet read) cancels
    nothing: the request is counted once, as finished."""
    with start(tiny) as server:
        gen, events = submit(server, chat_ids(tiny, PROMPT), 4)
        wait_for(lambda: events and isinstance(events[-1], Finished))
        assert server.server.scheduler.cancel(gen) is False
        assert metric(server, "spectrain_cancelled_total") == 0
        assert metric(server, "spectrain_completion_tokens_total") == 4
