"""DFlash and P-EAGLE on the engine loop (inference.algorithms.parallel_drafting): requests run side by side, each in
its own row of the target and of the drafter cache, get exactly the tokens and counters of the same request run
alone, greedy and seeded, whoever their neighbours are (rows admitted as others end, prefill apart in spare rows or in
place, chains shortened near a row's budget, EOS inside an accepted chain). The target runner is exact (on a CPU,
fp32 and bf16), so the algorithms run their drafter row-exact and equality is bitwise. The checks are
test_engine_loop's."""

from __future__ import annotations

import copy

import pytest
import torch
from dflash_builders import make_drafter
from engine_helpers import counters, jobs, side_by_side, solo
from peagle_builders import make_peagle
from tiny_targets import tiny_llama

from inference.algorithms import build_algorithm
from inference.engine.loop import DecodeEngine
from inference.engine.state import Finished, RowRequest
from inference.runner import ModelRunner

VOCAB = 97
NAMES = ["dflash", "peagle"]


@pytest.fixture(scope="module")
def models():
    """A flat target (its distributions near uniform, so that sampled drafts of a random drafter are often
    accepted) and a random drafter of each kind over the full vocabulary, in fp32 and in bf16."""
    target = tiny_llama(0, vocab=VOCAB, layers=3)
    drafters = {
        "dflash": make_drafter(target, draft_vocab=VOCAB, block_size=4).eval(),
        "peagle": make_peagle(target, depths=4, draft_vocab=VOCAB),
    }
    return {
        "target": target,
        torch.float32: drafters,
        torch.bfloat16: {name: copy.deepcopy(d).to(torch.bfloat16) for name, d in drafters.items()},
    }


def algorithm(name: str, models, rows: int = 1, spare: bool = True, dtype: torch.dtype = torch.float32):
    runner = ModelRunner.from_hf_model(
        models["target"], max_batch_size=2 * rows if spare else rows, max_seq_len=160, dtype=dtype
    )
    return build_algorithm(name, runner, models[dtype][name])


def check_side_by_side(models, name: str, spare: bool, dtype: torch.dtype) -> None:
    lone = algorithm(name, models, dtype=dtype)
    assert lone.target.exact and lone.drafter.row_exact  # the target runner is exact: so is the drafter
    all_jobs = jobs()
    eos = solo(lone, all_jobs[0]).tokens[9]  # met early by some rows, inside accepted chains
    expected = [solo(lone, job, eos_ids=[eos]) for job in all_jobs]
    events = side_by_side(algorithm(name, models, rows=3, spare=spare, dtype=dtype), all_jobs, rows=3, eos_ids=[eos])
    for k, want in enumerate(expected):
        event = events[k]
        assert isinstance(event, Finished), event
        assert event.result.tokens == want.tokens, f"request {k}"
        assert counters(event.result.stats) == counters(want.stats), f"request {k}"
    assert sum(r.stats.accepted_draft_tokens for r in expected) >= 15  # drafts really are accepted
    assert any(len(r.stats.accepted_hist) > 2 for r in expected)  # rounds that kept two drafts or more


@pytest.mark.parametrize("spare", [True, False], ids=["prefill-apart", "prefill-in-place"])
@pytest.mark.parametrize("name", NAMES)
def test_each_request_gets_the_tokens_and_counters_of_its_run_alone(models, name, spare):
    check_side_by_side(models, name, spare, torch.float32)


@pytest.mark.parametrize("name", NAMES)
def test_in_bf16_too(models, name):
    """A bf16 target in exact mode and a bf16 drafter row-exact (its linears run the fp32 kernel on bf16 values)."""
    check_side_by_side(models, name, True, torch.bfloat16)


def test_a_cancelled_row_is_refilled_and_every_other_request_gets_its_run_alone(models):
    """Request 2 is cancelled after two steps (a client that went away): its row takes the next request, whose
    drafter cache row starts empty; every request that ran to its end gets its solo tokens."""
    lone, alg = algorithm("peagle", models), algorithm("peagle", models, rows=3)
    all_jobs = jobs()
    engine = DecodeEngine(alg.target, alg.strategy(), rows=3)
    queue = [RowRequest(k, p, b, s, torch.Generator().manual_seed(seed)) for k, (p, b, s, seed) in enumerate(all_jobs)]
    events = {e.key: e for e in engine.admit([queue.pop(0) for _ in range(3)])}
    for _ in range(2):
        events.update((e.key, e) for e in engine.step())
    assert engine.cancel(2) and 2 not in events
    engine.run(lambda: queue.pop(0) if queue else None, lambda event: events.setdefault(event.key, event))
    assert sorted(events) == [0, 1, 3, 4, 5, 6]
    for k in events:
        assert events[k].result.tokens == solo(lone, all_jobs[k]).tokens, f"request {k}"
