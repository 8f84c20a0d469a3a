"""PEARL, SpecBranch and SSD on the engine loop: their draft work runs beside the engine's target forward
(``Strategy.beside``), one row at a time. A request alone is a one-row engine run; side by side rows are refused in
one line; a target forward that fails while the draft side works beside it fails that request only, and the next
request gets the tokens it would get on a fresh algorithm. Their tokens and counters are checked in test_pearl.py,
test_specbranch.py and test_ssd.py."""

from __future__ import annotations

import pytest
from pearl_helpers import PROMPT, ar_tokens, tiny_pair
from tiny_targets import GREEDY, runner

from core.errors import UserError
from inference.algorithms import build_algorithm
from inference.engine.loop import DecodeEngine

OPTIONS = {"pearl": {"gamma": 3}, "specbranch": {"gamma": 3, "kmax": 3}, "ssd": {"gamma": 3, "budget": 3}}


@pytest.fixture(scope="module")
def pair():
    return tiny_pair()


@pytest.mark.parametrize("name", OPTIONS)
def test_side_by_side_rows_are_refused_in_one_line(pair, name):
    target, draft = pair
    algorithm = build_algorithm(name, runner(target, rows=2), runner(draft, rows=3), **OPTIONS[name])
    engine = DecodeEngine(algorithm.target, algorithm.strategy(), rows=2)
    with pytest.raises(UserError, match=f"{name} takes one request at a time.*batch_size=1") as info:
        engine.open()
    assert "\n" not in str(info.value)
    algorithm.close()


@pytest.mark.parametrize("name", OPTIONS)
def test_a_target_forward_failing_beside_the_draft_fails_that_request_alone(pair, name):
    """The draft job runs in a worker thread (executor cuda_streams, on a CPU) while the engine's step forward
    fails: the request raises that error, and the next request (a new prefill, a restarted draft side) is AR's."""
    target, draft = pair
    algorithm = build_algorithm(name, runner(target), runner(draft, rows=3), executor="cuda_streams", **OPTIONS[name])
    forward, calls = algorithm.target.forward, []

    def fail_the_second_forward(*args, **kwargs):
        calls.append(1)
        if len(calls) == 2:  # the first step after the prefill
            raise RuntimeError("injected target failure")
        return forward(*args, **kwargs)

    algorithm.target.forward = fail_the_second_forward
    try:
        with pytest.raises(RuntimeError, match="injected target failure"):
            algorithm.generate(PROMPT, max_new_tokens=12, sampling=GREEDY)
        assert algorithm.generate(PROMPT, max_new_tokens=12, sampling=GREEDY).tokens == ar_tokens(target, 12)
    finally:
        algorithm.close()
