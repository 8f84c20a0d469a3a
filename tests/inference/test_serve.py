"""``inference.serve`` driven by the real ``openai`` client over HTTP, on a tiny random target with SmolLM2's
tokenizer: every algorithm's greedy answer equals AR's token for token (streamed or not), concurrent clients get
the sequential answers, bad requests get OpenAI's error JSON, a full queue answers 429, a client that goes away
frees its slot, and ``adapt=bandit`` learns while serving without changing a token."""

from __future__ import annotations

import random
import re
import threading

import httpx
import openai
import pytest
import torch
from serve_helpers import (
    CLIENT_TLS,
    http_client,
    ALGORITHMS,
    MAX_SEQ,
    PROMPT,
    Paced,
    ROWS,
    chat_ids,
    error_of,
    metric,
    reference,
    runner_of,
    start,
    tiny_models,
    wait_for,
)

from core.errors import UserError
from inference.algorithms import build_algorithm
from inference.drafters import load_lm
from inference.runner_loading import load_runner
from inference.sampling import SamplingParams
from inference.serve.engine import serving_batch
from inference.serve.server import RunningServer, main


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return tiny_models(tmp_path_factory.mktemp("serve"))


def client(server: RunningServer) -> openai.OpenAI:
    return openai.OpenAI(
        base_url=f"{server.url}/v1",
        api_key="none",
        max_retries=0,
        timeout=60,
        http_client=openai.DefaultHttpxClient(verify=CLIENT_TLS),
    )


@pytest.mark.parametrize("name", list(ALGORITHMS))
def test_every_algorithm_answers_as_ar_streamed_or_not(tiny, name):
    n = 12
    expected = reference(tiny, chat_ids(tiny, PROMPT), n)
    with start(tiny, *ALGORITHMS[name]) as server:
        api = client(server)
        messages = [{"role": "user", "content": PROMPT}]
        full = api.chat.completions.create(
            model="tiny", messages=messages, max_tokens=n, temperature=0, extra_body={"return_token_ids": True}
        )
        chunks = list(
            api.chat.completions.create(
                model="tiny",
                messages=messages,
                max_tokens=n,
                temperature=0,
                stream=True,
                stream_options={"include_usage": True},
                extra_body={"return_token_ids": True},
            )
        )
    assert full.choices[0].token_ids == expected, name
    assert full.choices[0].message.content == tiny["target"].tokenizer.decode(expected, skip_special_tokens=True)
    streamed = [c.choices[0] for c in chunks if c.choices]
    assert [t for c in streamed for t in (getattr(c, "token_ids", None) or [])] == expected
    assert "".join(c.delta.content or "" for c in streamed) == full.choices[0].message.content
    assert streamed[-1].finish_reason == full.choices[0].finish_reason == "length"
    usage = chunks[-1].usage
    assert (usage.prompt_tokens, usage.completion_tokens) == (len(chat_ids(tiny, PROMPT)), n)
    spec = full.usage.speculative  # AR: one forward per token; the others: tau is tokens per target forward
    if name == "ar":
        assert (spec["target_forwards"], spec["tau"]) == (n, 1.0)
    else:
        assert 1 <= spec["target_forwards"] <= n and spec["tau"] == pytest.approx(n / spec["target_forwards"], 1e-3)


@pytest.fixture(scope="module")
def ar_server(tiny):
    with start(tiny, "max_queue=64") as server:
        yield server


def test_completions_stream_and_stop_strings(tiny, ar_server):
    api = client(ar_server)
    ids = tiny["target"].tokenizer("Once upon a time", add_special_tokens=True)["input_ids"]
    expected = reference(tiny, ids, 16)
    full = api.completions.create(model="tiny", prompt="Once upon a time", max_tokens=16, temperature=0)
    text = tiny["target"].tokenizer.decode(expected, skip_special_tokens=True)
    assert full.choices[0].text == text and full.usage.completion_tokens == 16
    streamed = api.completions.create(model="tiny", prompt=ids, max_tokens=16, temperature=0, stream=True)
    assert "".join(c.choices[0].text for c in streamed if c.choices) == text
    stop = text[len(text) // 2 : len(text) // 2 + 3]
    stopped = api.completions.create(model="tiny", prompt=ids, max_tokens=16, temperature=0, stop=[stop])
    assert stopped.choices[0].text == text[: text.index(stop)] and stopped.choices[0].finish_reason == "stop"
    assert stopped.usage.completion_tokens < 16
    chunks = api.completions.create(model="tiny", prompt=ids, max_tokens=16, temperature=0, stop=stop, stream=True)
    assert "".join(c.choices[0].text for c in chunks if c.choices) == stopped.choices[0].text


def at_once(ask, jobs: list[tuple], timeout: float) -> None:
    """``ask(i, *job)`` for every job, each in its own thread, all at once; waits up to ``timeout`` for each."""
    threads = [threading.Thread(target=ask, args=(i, *job)) for i, job in enumerate(jobs)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout)


def test_concurrent_clients_get_the_sequential_answers(tiny, ar_server):
    """24 clients at once (batched AR over 8 rows, half streaming, some sampling with a seed): every request is
    answered with the tokens of a sequential AR run, nothing lost."""
    api = client(ar_server)
    jobs = [(f"Count to {i}." + " Go on." * (i % 4), 6 + i % 7, 0.0 if i % 3 else 0.8, i) for i in range(24)]
    results: dict[int, list[int]] = {}

    def ask(i, content, n, temperature, seed):
        kw = dict(
            model="tiny",
            messages=[{"role": "user", "content": content}],
            max_tokens=n,
            temperature=temperature,
            seed=seed if temperature else openai.NOT_GIVEN,  # greedy: no seed
            extra_body={"return_token_ids": True},
        )
        if i % 2:
            chunks = api.chat.completions.create(stream=True, **kw)
            results[i] = [t for c in chunks if c.choices for t in (getattr(c.choices[0], "token_ids", None) or [])]
        else:
            results[i] = api.chat.completions.create(**kw).choices[0].token_ids

    at_once(ask, jobs, timeout=120)
    assert sorted(results) == list(range(24))
    for i, (content, n, temperature, seed) in enumerate(jobs):
        assert results[i] == reference(tiny, chat_ids(tiny, content), n, temperature, seed), i


@pytest.mark.parametrize(
    "keys",
    [
        ["algorithm=sps", "gamma=3"],
        ["algorithm=sps@verifier=hsd", "gamma=3"],
        ["algorithm=sps", "gamma=3", "max_step_tokens=8"],
    ],
    ids=["sps", "sps-hsd", "sps-step-budget"],
)
def test_concurrent_speculative_clients_get_their_answers_alone(tiny, keys):
    """16 clients at once against SpS served side by side (8 rows, a third seeded): greedy answers are
    AR's; a seeded answer and every answer's ``usage.speculative`` counters are those of the same request run
    alone by the server's own algorithm (without a step budget: under one, widths shrink with the load)."""
    jobs = [(f"Count to {i}." + " Go on." * (i % 4), 6 + i % 9, 0.0 if i % 3 else 0.8, i) for i in range(16)]
    results: dict[int, object] = {}
    with start(tiny, *keys) as server:
        api, model = client(server), server.server.model
        assert model.batch_size == ROWS
        health = http_client.get(f"{server.url}/health").json()
        budget = "max_step_tokens=8" in keys
        assert health["batching"]["max_step_tokens"] == (8 if budget else 0)

        def ask(i, content, n, temperature, seed):
            kw = dict(
                model="tiny",
                messages=[{"role": "user", "content": content}],
                max_tokens=n,
                temperature=temperature,
                seed=seed if temperature else openai.NOT_GIVEN,
                extra_body={"return_token_ids": True},
            )
            results[i] = api.chat.completions.create(**kw)

        at_once(ask, jobs, timeout=180)
    assert sorted(results) == list(range(16))
    lone = build_algorithm(
        "sps",
        load_runner(tiny["target"].model, max_seq_len=MAX_SEQ),
        load_runner(load_lm(str(tiny["draft"]), max_seq_len=MAX_SEQ).model, max_seq_len=MAX_SEQ),
        gamma=3,
        verifier="hsd" if "hsd" in keys[0] else "tokenwise",
    )
    eos = [tiny["target"].tokenizer.eos_token_id]
    for i, (content, n, temperature, seed) in enumerate(jobs):
        ids = chat_ids(tiny, content)
        answer = results[i].choices[0].token_ids
        if not temperature:
            assert answer == reference(tiny, ids, n), i
        if budget:
            continue
        alone = lone.generate(
            ids,
            max_new_tokens=n,
            sampling=SamplingParams(temperature),
            eos_ids=eos,
            generator=torch.Generator().manual_seed(seed),
        )
        assert answer == alone.tokens, i
        usage = results[i].usage.model_extra["speculative"]
        assert usage["target_forwards"] == alone.stats.target_forwards, i


def test_a_request_that_sets_no_sampling_uses_the_servers(tiny, ar_server):
    """No temperature in the request: the server's (OpenAI's 1.0 by default, ``temperature=0`` greedy); a
    request's own temperature wins over the server's."""
    ids, n = chat_ids(tiny, PROMPT), 12
    messages = [{"role": "user", "content": PROMPT}]
    unset = client(ar_server).chat.completions.create(
        model="tiny", messages=messages, max_tokens=n, seed=7, extra_body={"return_token_ids": True}
    )
    assert unset.choices[0].token_ids == reference(tiny, ids, n, temperature=1.0, seed=7)
    with start(tiny, "temperature=0") as greedy_server:
        api = client(greedy_server)
        greedy = api.chat.completions.create(
            model="tiny", messages=messages, max_tokens=n, seed=7, extra_body={"return_token_ids": True}
        )
        sampled = api.chat.completions.create(
            model="tiny",
            messages=messages,
            max_tokens=n,
            seed=7,
            temperature=1.0,
            extra_body={"return_token_ids": True},
        )
    assert greedy.choices[0].token_ids == reference(tiny, ids, n)
    assert sampled.choices[0].token_ids == unset.choices[0].token_ids != greedy.choices[0].token_ids


def test_the_servers_seed_seeds_the_requests_that_set_none(tiny):
    """``seed=5``: unseeded requests draw their seeds from a stream seeded by 5, so a restarted server answers the
    same requests alike; each request still gets a seed of its own."""
    ids, messages = chat_ids(tiny, PROMPT), [{"role": "user", "content": PROMPT}]
    answers = []
    for _ in range(2):
        with start(tiny, "seed=5", "temperature=1.0") as server:
            api = client(server)
            answers.append(
                [
                    api.chat.completions.create(
                        model="tiny", messages=messages, max_tokens=12, extra_body={"return_token_ids": True}
                    )
                    .choices[0]
                    .token_ids
                    for _ in range(2)
                ]
            )
    assert answers[0] == answers[1]
    seeds = random.Random(5)
    assert answers[0] == [reference(tiny, ids, 12, temperature=1.0, seed=seeds.getrandbits(63)) for _ in range(2)]
    assert answers[0][0] != answers[0][1]


def test_bad_requests_get_openai_errors_and_the_server_keeps_serving(tiny, ar_server):
    url = f"{ar_server.url}/v1/chat/completions"
    ok = {"model": "tiny", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 3, "temperature": 0}
    long = {**ok, "messages": [{"role": "user", "content": "word " * 400}]}
    cases = [
        ({**ok, "model": "gpt-4"}, 404, "model", "model_not_found"),
        (long, 400, "messages", "context_length_exceeded"),
        ({**ok, "max_tokens": MAX_SEQ}, 400, "messages", "context_length_exceeded"),
        ({**ok, "temperature": "hot"}, 400, "temperature", None),
        ({**ok, "max_tokens": "ten"}, 400, "max_tokens", None),
        ({**ok, "top_p": 0}, 400, "top_p", None),
        ({**ok, "n": 2}, 400, "n", None),
        # OpenAI fields the engine does not implement, set to act, are refused by name
        ({**ok, "frequency_penalty": 0.5}, 400, "frequency_penalty", None),
        ({**ok, "presence_penalty": -1}, 400, "presence_penalty", None),
        ({**ok, "logit_bias": {"42": 5}}, 400, "logit_bias", None),
        ({**ok, "top_logprobs": 2}, 400, "top_logprobs", None),
        ({**ok, "tools": [{"type": "function", "function": {"name": "f"}}]}, 400, "tools", None),
        ({**ok, "response_format": {"type": "json_object"}}, 400, "response_format", None),
        ({**ok, "repetition_penalty": 1.2}, 400, "repetition_penalty", None),
        # at temperature 0 a filter or a seed would do nothing
        ({**ok, "top_k": 5}, 400, "top_k", None),
        ({**ok, "top_p": 0.9}, 400, "top_p", None),
        ({**ok, "seed": 3}, 400, "seed", None),
        ({k: v for k, v in ok.items() if k != "messages"}, 400, "messages", None),
    ]
    for body, status, param, code in cases:
        response = http_client.post(url, json=body)
        assert response.status_code == status, body
        error = error_of(response)
        assert (error["param"], error["code"]) == (param, code), error
    assert error_of(http_client.post(url, json={**ok, "logit_bias": {"42": 5}}))["message"] == (
        "logit_bias: a logit bias is not served; leave it unset (null or {})"
    )
    assert error_of(http_client.post(url, json={**ok, "seed": 3}))["message"] == (
        "seed: seed does nothing at temperature=0 (greedy: the argmax, nothing drawn); set temperature > 0 to "
        "sample, or leave seed unset"
    )
    # the official client sends only what its caller set: neutral values and null are served, and so are fields
    # that change nothing (user); top_k, top_p and seed with a temperature that samples
    neutral = client(ar_server).chat.completions.create(
        model="tiny",
        messages=ok["messages"],
        max_tokens=3,
        temperature=0,
        frequency_penalty=0,
        presence_penalty=0,
        logit_bias={},
        n=1,
        logprobs=False,
        top_p=1,
        user="someone",
        tool_choice="none",
        response_format={"type": "text"},
        extra_body={"top_k": -1, "return_token_ids": True, "best_of": None},
    )
    assert neutral.choices[0].token_ids == reference(tiny, chat_ids(tiny, "Hi"), 3)
    sampled = client(ar_server).chat.completions.create(
        model="tiny", messages=ok["messages"], max_tokens=3, temperature=0.7, top_p=0.9, seed=1, extra_body={"top_k": 5}
    )
    assert sampled.choices[0].finish_reason == "length"
    with pytest.raises(openai.BadRequestError, match="frequency_penalty"):
        client(ar_server).chat.completions.create(model="tiny", messages=ok["messages"], frequency_penalty=1.0)
    not_json = http_client.post(url, content=b"{not json", headers={"content-type": "application/json"})
    assert not_json.status_code == 400 and error_of(not_json)["type"] == "invalid_request_error"
    nothing = http_client.get(f"{ar_server.url}/v1/nothing")
    assert nothing.status_code == 404 and error_of(nothing)["type"] == "invalid_request_error"
    with pytest.raises(openai.NotFoundError):
        client(ar_server).chat.completions.create(model="gpt-4", messages=ok["messages"])
    assert http_client.post(url, json=ok).json()["choices"][0]["finish_reason"] == "length"
    health = http_client.get(f"{ar_server.url}/health").json()  # batched AR rows on a CPU: exact, and it says so
    assert (
        health["status"] == "ok"
        and health["queue"] == 0
        and health["exactness"]["path"] == "exact"
        and health["exactness"]["bitwise"]
    )
    models = client(ar_server).models.list()
    assert [m.id for m in models.data] == ["tiny"]


def test_metrics_count_one_request_its_tokens_forwards_and_tau(ar_server):
    """What one finished 4-token request adds (the module's server has answered others before: deltas)."""
    counted = {
        "spectrain_prompt_tokens_total": 3,
        "spectrain_completion_tokens_total": 4,
        "spectrain_target_forwards_total": 4,
        "spectrain_tau_count": 1,
        "spectrain_tau_sum": 1.0,
        "spectrain_request_seconds_count": 1,
        "spectrain_time_to_first_token_seconds_count": 1,
    }
    ok = {"endpoint": "/v1/completions", "status": "200"}
    before = {name: metric(ar_server, name) for name in counted}
    answered = metric(ar_server, "spectrain_requests_total", **ok)
    response = http_client.post(
        f"{ar_server.url}/v1/completions",
        json={"model": "tiny", "prompt": [5, 6, 7], "max_tokens": 4, "temperature": 0},
    )
    assert response.status_code == 200 and response.json()["usage"]["completion_tokens"] == 4
    assert {name: metric(ar_server, name) - before[name] for name in counted} == counted
    assert metric(ar_server, "spectrain_requests_total", **ok) == answered + 1
    assert metric(ar_server, "spectrain_queue_depth") == metric(ar_server, "spectrain_running") == 0
    assert metric(ar_server, "spectrain_info", algorithm="ar") == 1


def test_a_client_that_disconnects_frees_its_row(tiny, ar_server):
    with Paced(runner_of(ar_server)) as paced:
        with http_client.stream(
            "POST",
            f"{ar_server.url}/v1/completions",
            json={"model": "tiny", "prompt": [5, 6, 7], "max_tokens": 200, "temperature": 0, "stream": True},
        ) as response:
            assert next(line for line in response.iter_lines() if line.startswith("data:"))
        wait_for(
            lambda: metric(ar_server, "spectrain_cancelled_total") >= 1 and metric(ar_server, "spectrain_running") == 0
        )
        assert paced.calls < 100  # the row stopped long before its 200 tokens
        with pytest.raises(httpx.ReadTimeout):  # a non-streaming client that gives up waiting
            http_client.post(
                f"{ar_server.url}/v1/completions",
                timeout=0.3,
                json={"model": "tiny", "prompt": [5, 6, 7], "max_tokens": 200, "temperature": 0},
            )
        wait_for(
            lambda: metric(ar_server, "spectrain_cancelled_total") >= 2 and metric(ar_server, "spectrain_running") == 0
        )
        assert paced.calls < 200
    answer = http_client.post(
        f"{ar_server.url}/v1/completions",
        json={"model": "tiny", "prompt": [5, 6, 7], "max_tokens": 5, "temperature": 0},
    )
    assert answer.json()["usage"]["completion_tokens"] == 5


def test_a_full_queue_answers_429_and_a_dropped_stream_lets_the_next_one_in(tiny):
    """One request at a time and one waiting place: a stream holds the engine, a second request waits, a third is
    refused with 429; closing the stream ends its generation and the waiting one is answered."""
    gate = threading.Event()
    with start(tiny, "batch_size=1", "max_queue=1") as server, Paced(runner_of(server), gate) as paced:
        url = f"{server.url}/v1/completions"
        body = {"model": "tiny", "prompt": [5, 6, 7], "temperature": 0}
        waiting: dict = {}
        with http_client.stream("POST", url, json={**body, "max_tokens": 200, "stream": True}):
            wait_for(lambda: metric(server, "spectrain_running") == 1)  # held at its first forward
            thread = threading.Thread(
                target=lambda: waiting.update(r=http_client.post(url, json={**body, "max_tokens": 4}, timeout=60))
            )
            thread.start()
            wait_for(lambda: metric(server, "spectrain_queue_depth") == 1)
            refused = http_client.post(url, json={**body, "max_tokens": 4})
            assert refused.status_code == 429 and error_of(refused)["code"] == "queue_full"
        wait_for(lambda: metric(server, "spectrain_cancelled_total") == 1)
        gate.set()
        thread.join(60)
        assert waiting["r"].status_code == 200 and waiting["r"].json()["usage"]["completion_tokens"] == 4
        assert metric(server, "spectrain_completion_tokens_total") == 4  # the dropped stream counts nothing
        assert paced.calls <= 2 + 4  # the dropped stream's prefill (+ at most one step), then the 4-token answer


def test_adapter_learns_from_requests_side_by_side_and_output_stays_ar(tiny):
    forcing = [
        "adapt_prior=5",
        "adapt_min_gap=1",
        "adapt_cost_cache=null",
        "adapt_cost_rows=24",
        "adapt_head_lr=1e-2",
        "adapt_full_lr=1e-2",
        "adapt_validate=false",
    ]
    before = {k: v.clone() for k, v in tiny["eagle3"].state_dict().items()}
    contents = ("Name a prime.", "Name a colour.", "Name a city.", "Name a tree.")
    answers: dict[int, list[int]] = {}
    with start(tiny, *ALGORITHMS["eagle3_tree"], "adapt=bandit", *forcing) as server:
        api = client(server)
        batching = http_client.get(f"{server.url}/health").json()["batching"]
        assert batching["batch_size"] == ROWS and batching["adapter"] == "bandit"  # side by side, adapting

        def ask(i, content):
            answers[i] = api.chat.completions.create(
                model="tiny",
                messages=[{"role": "user", "content": content}],
                max_tokens=12,
                temperature=0,
                extra_body={"return_token_ids": True},
            )

        at_once(ask, [(content,) for content in contents], timeout=120)
        for i, content in enumerate(contents):
            assert answers[i].choices[0].token_ids == reference(tiny, chat_ids(tiny, content), 12), i
        text = http_client.get(f"{server.url}/metrics").text
        updates = sum(
            float(v)
            for arm, v in re.findall(r'spectrain_adapter_decisions_total\{arm="(\w+)"\} (\S+)', text)
            if arm != "skip"
        )
        served = server.server.model.algorithm.drafter.state_dict()
    assert updates >= 1
    assert any(not torch.equal(before[k], served[k]) for k in before)  # the served copy learned
    assert all(torch.equal(before[k], v) for k, v in tiny["eagle3"].state_dict().items())  # not the loaded one


def test_cli_refuses_bad_keys_in_one_line(capsys):
    assert main(["algorithm=nope"]) == 2
    assert main(["algorithm=[ar,sps]"]) == 2
    assert main(["port=70000"]) == 2
    assert main(["algorithm=sps@bogus=1"]) == 2
    assert main(["algorithm=ar@max_new_tokens=0"]) == 2
    errors = capsys.readouterr().err.strip().splitlines()
    assert len(errors) == 5 and all(line.startswith("error: ") for line in errors)
    assert "unknown algorithm 'nope'" in errors[0] and "one algorithm" in errors[1] and "port=70000" in errors[2]
    assert "'ar@max_new_tokens=0': max_new_tokens=0 must be >= 1" in errors[4]


def test_engine_loop_algorithms_batch_and_auto_batches_where_batched_rows_stay_exact():
    for name in ("ar", "sps", "dflash", "peagle", "eagle3_tree", "specblock_tree", "self_draft"):
        assert serving_batch(0, name, torch.float32) == 8 and serving_batch(0, name, torch.bfloat16) == 8
        assert serving_batch(0, name, torch.bfloat16, "cuda") == 1
        assert serving_batch(0, name, torch.float32, "cuda") == 8
        assert serving_batch(4, name, torch.bfloat16) == 4
    assert serving_batch(0, "pearl", torch.float32) == serving_batch(1, "pearl", torch.float32) == 1
    with pytest.raises(UserError, match="pearl serves one request at a time.*batch_size=1"):
        serving_batch(4, "pearl", torch.float32)


def test_a_step_budget_where_it_does_nothing_is_refused(tiny):
    for keys in (
        ["max_step_tokens=4"],
        ["algorithm=sps", "batch_size=1", "max_step_tokens=4"],
        ["algorithm=dflash", "max_step_tokens=4"],
    ):
        with pytest.raises(UserError, match="max_step_tokens=4 does nothing here.*sps"):
            start(tiny, *keys)


def test_the_server_measures_its_costs_reports_the_policy_and_answers_as_ar(tiny):
    with start(tiny, "algorithm=sps", "gamma=3", "width_policy=cost") as server:
        batching = http_client.get(f"{server.url}/health").json()["batching"]
        assert batching["width_policy"] == "cost" and "measured" in batching["policy"]
        assert set(batching["target_s_by_rows"]) >= {"1", str(8 * 4)} and batching["draft_s"] > 0
        for content, n in (("Count to 3.", 9), ("Name a colour.", 6)):
            body = {
                "model": "tiny",
                "messages": [{"role": "user", "content": content}],
                "max_tokens": n,
                "temperature": 0,
                "return_token_ids": True,
            }
            answer = http_client.post(f"{server.url}/v1/chat/completions", json=body, timeout=60).json()
            assert answer["choices"][0]["token_ids"] == reference(tiny, chat_ids(tiny, content), n)
    for keys, match in (
        (["algorithm=sps", "width_policy=widest"], "width_policy=widest is unknown"),
        (["algorithm=sps", "width_policy=cost", "max_step_tokens=4"], "drop max_step_tokens"),
        (["width_policy=cost"], "width_policy=cost does nothing here.*sps"),
    ):
        with pytest.raises(UserError, match=match):
            start(tiny, *keys)


@pytest.mark.parametrize("name", ["dflash", "peagle", "specblock_tree", "self_draft"])
def test_concurrent_clients_of_a_parallel_drafter_get_their_answers_alone(tiny, name):
    """8 clients at once on 8 rows (every running row's chain, or SpecBlock's first blocks, drafted in one drafter
    call; Self-Draft: each row's grid and candidates), greedy and seeded sampling: each gets the tokens of the
    algorithm's run of its request alone."""
    options = {
        "specblock_tree": {"budget": 16, "width": 4},  # their ALGORITHMS keys
        "self_draft": {"branch_len": 3, "branch_num": 2},
    }.get(name, {})
    alone = build_algorithm(
        name,
        load_runner(tiny["target"].model, max_seq_len=MAX_SEQ),
        tiny.get("specblock" if name == "specblock_tree" else name),
        **options,
    )
    eos = tiny["target"].tokenizer.eos_token_id
    jobs = [(f"Count to {i}." + " Go on." * (i % 3), 5 + i % 6, 0.0 if i % 2 else 0.9, i) for i in range(ROWS)]
    results: dict[int, list[int]] = {}

    def ask(i, content, n, temperature, seed):
        results[i] = (
            client(server)
            .chat.completions.create(
                model="tiny",
                messages=[{"role": "user", "content": content}],
                max_tokens=n,
                temperature=temperature,
                seed=seed if temperature else openai.NOT_GIVEN,
                extra_body={"return_token_ids": True},
            )
            .choices[0]
            .token_ids
        )

    with start(tiny, *ALGORITHMS[name]) as server:
        at_once(ask, jobs, timeout=120)
    assert sorted(results) == list(range(ROWS))
    for i, (content, n, temperature, seed) in enumerate(jobs):
        assert (
            results[i]
            == alone.generate(
                chat_ids(tiny, content),
                max_new_tokens=n,
                sampling=SamplingParams(temperature),
                eos_ids=[eos],
                generator=torch.Generator().manual_seed(seed),
            ).tokens
        ), i
