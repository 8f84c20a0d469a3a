"""One request must not fail its neighbours: a request the engine cannot serve is refused at the schema (400
naming the field) or over the size limits (413); a row that fails in the batched engine ends alone, the others'
answers equal their sequential ones; a failure on the target side or in the draft process leaves the next
request a correct answer."""

from __future__ import annotations

import logging
import re
import threading

import pytest
import torch
from serve_helpers import (
    http_client,
    MAX_SEQ,
    PROMPT,
    Paced,
    chat_ids,
    error_of,
    metric,
    reference,
    runner_of,
    start,
    submit,
    tiny_models,
    wait_for,
)

from inference.sampling import sample, warp_probs
from inference.serve.scheduler import Chunk, Failed, Finished


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return tiny_models(tmp_path_factory.mktemp("serve_failures"))


def test_a_tiny_temperature_samples_the_argmax_instead_of_nan():
    logits = torch.tensor([[1.0, 3.0, 2.0, 3.0 - 1e-6], [-40.0, 0.0, 50.0, 49.0]])
    probs = warp_probs(logits, 1e-45)  # logits / 1e-45 overflow to inf; shifted by the max first they do not
    assert probs.tolist() == [[0.0, 1.0, 0.0, 0.0], [0.0, 0.0, 1.0, 0.0]]
    assert sample(probs, torch.Generator().manual_seed(0)).tolist() == [1, 2]
    assert torch.allclose(warp_probs(logits, 0.7), (logits / 0.7).softmax(-1))  # the shift changes nothing else


POISONED = [  # (field, value): each alone makes a request the engine cannot serve
    ("seed", 2**64),
    ("seed", -1),
    ("temperature", 1e-45),
    ("stop", ["x" * 257]),
    ("stop", ["a", "b", "c", "d", "e"]),
]


def test_poisoned_requests_are_refused_and_a_full_batch_beside_them_is_answered_as_sequential_ar(tiny):
    """Eight good requests (greedy and seeded sampling) fill the batch while five poisoned ones arrive among them:
    each poisoned one gets a 400 naming its field, each good one its sequential AR answer."""
    gate = threading.Event()
    good = [(f"Count to {i}.", 6 + i, 0.0 if i % 2 else 0.8, i) for i in range(8)]
    results: dict = {}
    with start(tiny) as server, Paced(runner_of(server), gate):
        url = f"{server.url}/v1/chat/completions"

        def ask(key, body):
            results[key] = http_client.post(url, json={"model": "tiny", "return_token_ids": True, **body}, timeout=60)

        bodies = {
            i: {
                "messages": [{"role": "user", "content": c}],
                "max_tokens": n,
                "temperature": t,
                **({"seed": s} if t else {}),
            }
            for i, (c, n, t, s) in enumerate(good)
        }  # greedy: no seed
        for k, (field, value) in enumerate(POISONED):
            bodies[("poison", k)] = {**bodies[k], field: value}
        threads = [threading.Thread(target=ask, args=item) for item in bodies.items()]
        for t in threads:
            t.start()
        wait_for(lambda: len(results) == len(POISONED))  # refused before the engine: no forward needed
        gate.set()
        for t in threads:
            t.join(60)
        assert metric(server, "spectrain_failed_total") == 0
    for k, (field, _) in enumerate(POISONED):
        response = results[("poison", k)]
        assert response.status_code == 400 and error_of(response)["param"] == field, (field, response.text)
    for i, (content, n, temperature, seed) in enumerate(good):
        assert results[i].status_code == 200, results[i].text
        assert results[i].json()["choices"][0]["token_ids"] == reference(
            tiny, chat_ids(tiny, content), n, temperature, seed
        ), i


def test_a_row_that_fails_in_the_batched_engine_ends_alone(tiny):
    """Past the schema, a seed torch cannot take fails its row at its first sampled token, and a prompt that does
    not fit fails before it gets a row; the six rows beside them finish with their sequential AR answers."""
    gate = threading.Event()
    good = [(chat_ids(tiny, f"Name {i} primes."), 8 + i, 0.0 if i % 2 else 0.9, i) for i in range(6)]
    with start(tiny) as server, Paced(runner_of(server), gate):
        answers = [submit(server, *job)[1] for job in good[:1]]
        wait_for(lambda: metric(server, "spectrain_running") == 1)  # held in its prefill: the rest join it
        overflow = submit(server, chat_ids(tiny, PROMPT), 8, 1.0, 2**64)[1]
        answers += [submit(server, *job)[1] for job in good[1:3]]
        too_long = submit(server, list(range(5, 5 + MAX_SEQ - 4)), 8)[1]
        answers += [submit(server, *job)[1] for job in good[3:]]
        gate.set()
        wait_for(lambda: all(events and not isinstance(events[-1], Chunk) for events in [*answers, overflow, too_long]))
        assert metric(server, "spectrain_failed_total") == 2
    assert [type(e) for e in overflow] == [Failed] and "Overflow" in overflow[0].message
    assert [type(e) for e in too_long] == [Failed] and "max_seq_len" in too_long[0].message
    for events, (ids, n, temperature, seed) in zip(answers, good):
        assert isinstance(events[-1], Finished)
        assert [t for e in events[:-1] for t in e.token_ids] == reference(tiny, ids, n, temperature, seed)


def test_oversized_bodies_are_refused_with_413(tiny):
    body = {"model": "tiny", "prompt": "word " * 1000, "max_tokens": 2, "temperature": 0}
    with start(tiny, "max_body_bytes=4096") as server:
        url = f"{server.url}/v1/completions"
        declared = http_client.post(url, json=body)
        chunked = http_client.post(
            url,
            content=iter([b'{"model": "tiny", "prompt": "', b"word " * 1000, b'"}']),
            headers={"content-type": "application/json"},
        )  # no Content-Length: counted
        small = http_client.post(url, json={**body, "prompt": "word " * 10})
        assert metric(server, "spectrain_requests_total", endpoint="/v1/completions", status="413") == 2
    for response in (declared, chunked):
        assert response.status_code == 413 and "max_body_bytes=" in error_of(response)["message"]
    assert small.status_code == 200


@pytest.mark.timeout(300)
def test_target_and_draft_process_failures_leave_the_next_request_correct(tiny, caplog):
    """PEARL with its draft side in a second process. A target forward that fails mid-round leaves the draft's
    reply to that round unread: it is drained, so the next request does not read it as its own. A killed draft
    process fails the request that meets it; the next one starts a new draft process."""
    ids, n = chat_ids(tiny, PROMPT), 12
    expected = reference(tiny, ids, n)
    body = {
        "model": "tiny",
        "messages": [{"role": "user", "content": PROMPT}],
        "max_tokens": n,
        "temperature": 0,
        "return_token_ids": True,
    }
    with start(tiny, "algorithm=pearl", "gamma=3", "executor=multiprocess") as server, caplog.at_level(logging.ERROR):
        url = f"{server.url}/v1/chat/completions"
        runner = runner_of(server)

        def fail_once(*args, **kwargs):
            del runner.forward  # the class's method again
            raise RuntimeError("injected target failure")

        runner.forward = fail_once
        failed = http_client.post(url, json=body, timeout=120)
        after_target = http_client.post(url, json=body, timeout=120)
        executor = server.server.model.algorithm.executor
        executor.process.kill()
        executor.process.join(30)
        lost = http_client.post(url, json=body, timeout=120)
        after_draft = http_client.post(url, json=body, timeout=120)
    # The client hears the failure's type and its request's id; the log has its text under that id.
    for answer, text in ((failed, "injected target failure"), (lost, "draft process is gone")):
        message = error_of(answer)["message"]
        assert answer.status_code == 500 and "RuntimeError" in message and text not in message
        request_id = re.search(r"(chat)?cmpl-[0-9a-f]+", message).group()
        assert any(request_id in r.getMessage() and text in str(r.exc_info[1]) for r in caplog.records)
    assert after_target.status_code == 200 and after_target.json()["choices"][0]["token_ids"] == expected
    assert after_draft.status_code == 200 and after_draft.json()["choices"][0]["token_ids"] == expected
