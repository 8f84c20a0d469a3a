"""Test helpers over the engine loop: a tiny target with a close draft, mixed jobs (prompts, budgets, settings,
seeds), a job run alone or side by side with others, a stream consumer that fails or stops, the counters a run must
reproduce, and a request admitted alone, to read what its strategy holds after the prefill."""

from __future__ import annotations

import copy

import torch
from tiny_targets import tiny_llama

from inference.algorithms import build_algorithm
from inference.engine.loop import DecodeEngine
from inference.engine.state import Failed, Finished, RowRequest, RowState
from inference.runner import ModelRunner
from inference.sampling import SamplingParams


def admitted_alone(algorithm, prompt: list[int], max_new_tokens: int = 32) -> tuple[DecodeEngine, RowState]:
    """``algorithm``'s one-row engine after admitting ``prompt`` greedily: the row's state holds its first token
    (``pending``) and the strategy's drafter-side state (``draft``: the prompt's target features and next tokens)."""
    engine = DecodeEngine(algorithm.target, algorithm.strategy(), rows=1, max_seq_len=algorithm.max_seq_len)
    room = algorithm.max_seq_len - len(prompt) - algorithm.lookahead()
    ended = engine.admit([RowRequest(0, prompt, min(max_new_tokens, room), SamplingParams(0.0))])
    if ended:
        raise AssertionError(f"the request ended at admission: {ended}")
    return engine, engine.slots[0]


VOCAB = 97


GREEDY = SamplingParams(0.0)


SAMPLED = SamplingParams(1.0)


WARPED = SamplingParams(0.7, top_k=20, top_p=0.9)


VARIANTS = {"ar": {}, "sps": {"gamma": 4}, "sps@hsd": {"gamma": 3, "verifier": "hsd"}}


def target_and_draft():
    """A target with sharp distributions and a draft close to it (its weights perturbed), so drafts are accepted
    often but not always."""
    target = tiny_llama(0, vocab=VOCAB, layers=2, temperature_scale=6.0)
    draft = copy.deepcopy(target)
    generator = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for p in draft.parameters():
            p.add_(0.35 * p.std() * torch.randn(p.shape, generator=generator))
    return target, draft


def runner_of(model, rows: int = 1, spare: bool = True) -> ModelRunner:
    return ModelRunner.from_hf_model(model, max_batch_size=2 * rows if spare else rows, max_seq_len=160)


def algorithm(name: str, models, rows: int = 1, spare: bool = True):
    target, draft = models
    base, _, verifier = name.partition("@")
    return build_algorithm(
        base, runner_of(target, rows, spare), None if base == "ar" else runner_of(draft, rows, spare), **VARIANTS[name]
    )


def jobs(vocab: int = VOCAB) -> list[tuple[list[int], int, SamplingParams, int]]:
    """(prompt, budget, sampling, seed): mixed prompt lengths, budgets and settings."""
    generator = torch.Generator().manual_seed(3)
    lengths = (5, 1, 23, 9, 40, 2, 14)
    budgets = (24, 7, 31, 1, 18, 26, 12)
    settings = (GREEDY, SAMPLED, WARPED, SAMPLED, GREEDY, WARPED, SAMPLED)
    return [
        (torch.randint(0, vocab, (n,), generator=generator).tolist(), budget, sampling, 100 + k)
        for k, (n, budget, sampling) in enumerate(zip(lengths, budgets, settings))
    ]


def solo(alg, job, eos_ids=()):
    prompt, budget, sampling, seed = job
    return alg.generate(
        prompt, max_new_tokens=budget, sampling=sampling, eos_ids=eos_ids, generator=torch.Generator().manual_seed(seed)
    )


def side_by_side(alg, all_jobs, rows: int, eos_ids=(), on_tokens=None) -> dict:
    engine = DecodeEngine(alg.target, alg.strategy(), rows=rows, eos_ids=eos_ids)
    queue = [
        RowRequest(
            k,
            prompt,
            budget,
            sampling,
            torch.Generator().manual_seed(seed),
            None if on_tokens is None else (lambda new, k=k: on_tokens(k, new)),
        )
        for k, (prompt, budget, sampling, seed) in enumerate(all_jobs)
    ]
    events = {}
    engine.run(lambda: queue.pop(0) if queue else None, lambda event: events.setdefault(event.key, event))
    assert not engine.busy and engine.free_rows() == rows
    return events


def stream_consumer(fails: int, stops: int | None = None):
    """Each request's stream consumer: request ``fails``'s raises at its third token; request ``stops``'s returns
    False at its fifth (its client went away); the others take everything."""
    seen: dict[int, int] = {}

    def on_tokens(key, new) -> bool:
        seen[key] = seen.get(key, 0) + len(new)
        if key == fails and seen[key] >= 3:
            raise RuntimeError("consumer gone")
        return not (key == stops and seen[key] >= 5)

    return on_tokens


def counters(stats) -> tuple:
    return (
        stats.new_tokens,
        stats.target_forwards,
        stats.draft_forwards,
        stats.drafted_tokens,
        stats.accepted_draft_tokens,
        stats.rounds,
        stats.accepted_hist,
        stats.accepted_at,
        stats.attempted_at,
    )


def alone_and_side_by_side(lone, batched, all_jobs) -> list:
    """Each job run alone on ``lone``, then all of them side by side on ``batched`` (3 rows), with an EOS id that
    some rows meet early, inside accepted drafts: every request's tokens and counters must be its run alone's.
    Returns the runs alone."""
    eos = solo(lone, all_jobs[0]).tokens[9]
    expected = [solo(lone, job, eos_ids=[eos]) for job in all_jobs]
    assert any(eos in r.tokens for r in expected)
    events = side_by_side(batched, all_jobs, rows=3, eos_ids=[eos])
    for k, want in enumerate(expected):
        assert isinstance(events[k], Finished), events[k]
        assert events[k].result.tokens == want.tokens, f"request {k}"
        assert counters(events[k].result.stats) == counters(want.stats), f"request {k}"
    return expected


def after_a_failing_forward(alg, all_jobs) -> list[list[int]]:
    """Requests 0 and 1 in flight on a 2-row engine when the target's forward fails: both fail, and nothing else;
    then requests 2 and 3 run on the same engine. Returns the tokens those two got."""
    engine = DecodeEngine(alg.target, alg.strategy(), rows=2)
    requests = [
        RowRequest(k, p, b, s, torch.Generator().manual_seed(seed)) for k, (p, b, s, seed) in enumerate(all_jobs[:4])
    ]
    assert engine.admit(requests[:2]) == []
    forward = alg.target.forward
    alg.target.forward = lambda *a, **kw: (_ for _ in ()).throw(RuntimeError("device lost"))
    failed = engine.step()
    alg.target.forward = forward
    assert sorted(e.key for e in failed) == [0, 1] and all(isinstance(e, Failed) for e in failed)
    done, queue = [], requests[2:]
    engine.run(lambda: queue.pop(0) if queue else None, done.append)
    return [e.result.tokens for e in sorted(done, key=lambda e: e.key)]
