"""Exact mode over a batch of CPU rows (fp32 and bf16): a row's logits are bitwise those of the same row run alone,
whatever its neighbours, their number and their lengths (inference.llama.EXACT_ROWS, inference.exactness). Every
reference below is a one-row runner's own forward; the batched runner is built from the same weights."""

from __future__ import annotations

import pytest
import torch
from exact_helpers import rounds_differently_past
from tiny_targets import tiny_llama

from core.blocks.linear import Linear
from inference import exactness
from inference.algorithms import build_algorithm
from inference.batched_generation import ContinuousBatcher, Job
from inference.device import cpu_has_native_bf16
from inference.exactness import tree_mask
from inference.runner import ModelRunner
from inference.sampling import SamplingParams

native_bf16 = pytest.mark.skipif(not cpu_has_native_bf16(), reason="needs a CPU with native bf16 (AVX512-BF16/AMX)")
DTYPES = [torch.float32, pytest.param(torch.bfloat16, marks=native_bf16)]
VOCAB = 512


@pytest.fixture(scope="module")
def target():
    # sharp output distributions: greedy answers that do not all repeat one token
    return tiny_llama(
        0, vocab=VOCAB, layers=2, temperature_scale=20.0, hidden=64, intermediate=128, heads=4, kv_heads=2
    )


def runner_of(model, dtype, rows: int = 1, **kw) -> ModelRunner:
    return ModelRunner.from_hf_model(
        model, dtype=dtype, max_batch_size=rows, max_seq_len=kw.pop("max_seq_len", 256), **kw
    )


def random_ids(seed: int, *lengths: int) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return [torch.randint(0, VOCAB, (n,), generator=generator) for n in lengths]


def prefill_ragged(runner: ModelRunner, prompts: list[torch.Tensor]) -> None:
    """One padded forward of every prompt, then each row cut back to its own length."""
    ids = torch.zeros(len(prompts), max(len(p) for p in prompts), dtype=torch.long)
    for row, prompt in enumerate(prompts):
        ids[row, : len(prompt)] = prompt
    runner.reset(len(prompts))
    runner.forward(ids, logit_rows=slice(0, 0))
    runner.truncate(torch.tensor([len(p) for p in prompts]))


def solo_decode(solo: ModelRunner, prompt: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """[len(tokens), V]: each token decoded alone after the prompt."""
    solo.reset(1)
    solo.forward(prompt[None])
    return torch.cat([solo.forward(tokens[None, j : j + 1]).logits[0] for j in range(len(tokens))])


def test_the_mode_is_on_for_cpu_batches_by_default(target):
    for dtype in (torch.float32, torch.bfloat16):
        batched = runner_of(target, dtype, rows=4, probe=False)
        assert batched.exact and batched.exactness.path == exactness.EXACT
    off = runner_of(target, torch.float32, rows=4, exact=False)
    assert not off.exact and off.exactness.reason == "exact mode is off"


@pytest.mark.parametrize("dtype", DTYPES)
def test_batched_decode_gives_each_row_its_solo_logits(target, dtype):
    """Ragged rows decode side by side; then fewer rows (first_rows), rows rolled back one by one (truncate), and
    rows rebuilt from others (select_rows): every step's row is bitwise its solo decode."""
    lengths = (3, 17, 70, 1, 40)
    prompts = random_ids(1, *lengths)
    tokens = random_ids(2, *(8,) * len(lengths))
    solo = runner_of(target, dtype)
    expected = [solo_decode(solo, p, t) for p, t in zip(prompts, tokens)]
    batched = runner_of(target, dtype, rows=len(lengths))
    prefill_ragged(batched, prompts)
    step = torch.stack(tokens)
    for j in range(4):
        logits = batched.forward(step[:, j : j + 1]).logits[:, 0]
        for row in range(len(lengths)):
            assert torch.equal(logits[row], expected[row][j]), f"row {row}, step {j}"
    with batched.first_rows(2):  # the last rows sit out
        logits = batched.forward(step[:2, 4:5]).logits[:, 0]
    assert all(torch.equal(logits[row], expected[row][4]) for row in range(2))
    back = (3, 5, 2, 4, 1)  # each row rolled back to its own point, then decoded on from there
    batched.truncate(torch.tensor([n + k for n, k in zip(lengths, back)]))
    for j in range(2):
        logits = batched.forward(torch.stack([t[k + j] for t, k in zip(tokens, back)])[:, None]).logits[:, 0]
        for row in range(len(lengths)):
            assert torch.equal(logits[row], expected[row][back[row] + j]), f"row {row}, step {back[row] + j}"
    batched.select_rows([2, 2, 0], lengths[0] + 2)  # row 2 forked twice, cut to row 0's length
    logits = batched.forward(torch.stack([tokens[2][2:3], tokens[2][2:3], tokens[0][2:3]])).logits[:, 0]
    short = solo_decode(solo, prompts[2][: lengths[0] + 2], tokens[2][2:3])[0]
    assert torch.equal(logits[0], short) and torch.equal(logits[1], short)
    assert torch.equal(logits[2], expected[0][2])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("nodes", [9, 70])  # 70: more tokens than EXACT_ROWS, run in chunks over ragged rows
def test_batched_trees_give_each_row_its_solo_logits(target, dtype, nodes):
    """Each row verifies its own tree (its own mask and positions) in one [B, T] forward; each row's nodes get the
    logits the same tree gets alone, and after a per-row commit the next decode step too."""
    lengths = (5, 31, 12)
    prompts = random_ids(3, *lengths)
    generator = torch.Generator().manual_seed(nodes)
    trees, masks, depths = [], [], []
    for _ in lengths:
        parents = [-1] + [int(torch.randint(max(0, i - 4), i, (1,), generator=generator)) for i in range(1, nodes)]
        mask, depth = tree_mask(parents)
        trees.append(torch.randint(0, VOCAB, (nodes,), generator=generator))
        masks.append(mask)
        depths.append(torch.tensor(depth))
    solo = runner_of(target, dtype)
    expected, after = [], []
    for prompt, tree, mask, depth in zip(prompts, trees, masks, depths):
        solo.reset(1)
        solo.forward(prompt[None])
        expected.append(solo.forward(tree[None], attention_mask=mask, positions=(depth + len(prompt))[None]).logits[0])
        path = mask[-1].nonzero()[:, 0]
        solo.commit(path[None])
        after.append(solo.forward(tree[None, :1]).logits[0, 0])
    batched = runner_of(target, dtype, rows=len(lengths))
    prefill_ragged(batched, prompts)
    positions = torch.stack([d + n for d, n in zip(depths, lengths)])
    logits = batched.forward(torch.stack(trees), attention_mask=torch.stack(masks), positions=positions).logits
    for row in range(len(lengths)):
        assert torch.equal(logits[row], expected[row]), f"row {row}"
    batched.commit([m[-1].nonzero()[:, 0].tolist() for m in masks])  # each row keeps its own path
    logits = batched.forward(torch.stack([t[:1] for t in trees])).logits[:, 0]
    assert all(torch.equal(logits[row], after[row]) for row in range(len(lengths)))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("spare_rows", [True, False])  # prefill apart (row_block + copy_rows) or padded refills
def test_continuous_batching_answers_equal_solo_ar(target, dtype, spare_rows):
    """Greedy and seeded jobs of mixed lengths, three rows at a time with refills: each answer is its solo AR run's."""
    prompts = [p.tolist() for p in random_ids(5, 4, 23, 9, 1, 40, 14, 7)]
    greedy, seeded = SamplingParams(temperature=0), SamplingParams(temperature=1.0)
    jobs = [
        Job(i, p, 6 + 3 * (i % 3), seed=100 + i, sampling=greedy if i % 2 else seeded) for i, p in enumerate(prompts)
    ]
    ar = build_algorithm("ar", runner_of(target, dtype))
    expected = {
        job.key: ar.generate(
            job.ids,
            max_new_tokens=job.max_new_tokens,
            sampling=job.sampling,
            generator=torch.Generator().manual_seed(job.seed),
        ).tokens
        for job in jobs
    }
    batcher = ContinuousBatcher(
        runner_of(target, dtype, rows=6 if spare_rows else 3), batch_size=3, eos_ids=[], sampling=greedy
    )
    queue, answers = list(jobs), {}
    batcher.run(lambda: queue.pop(0) if queue else None, lambda job, tokens: answers.__setitem__(job.key, tokens))
    assert answers == expected
    assert len({tuple(t) for t in expected.values()}) == len(jobs)  # answers that tell rows apart


@pytest.mark.parametrize("dtype", DTYPES)
def test_a_host_whose_gemm_rows_depend_on_the_row_count_makes_batches_approximate(target, dtype, monkeypatch):
    """On a host (emulated) whose GEMM rounds calls of more than 4 rows differently for the lm_head's shape, the
    probe fails: one row still verifies token by token, bitwise; a batch's decode step is a call of as many rows, so
    a batched runner says so and runs the approximate path, with the plain caches."""
    monkeypatch.setattr(exactness, "_results", {})
    differs = rounds_differently_past(4)
    original = Linear.forward
    monkeypatch.setattr(
        Linear,
        "forward",
        lambda self, x, out_features=None: (differs if self.out_features == VOCAB else original)(self, x, out_features),
    )
    with pytest.warns(exactness.ExactnessWarning) as warned:
        batched = runner_of(target, dtype, rows=8)
    assert any("batched rows run the approximate path" in str(w.message) for w in warned)
    assert not batched.exact and batched.exactness.path == exactness.APPROXIMATE and not batched.exactness.bitwise
    assert batched.exactness.probe.startswith("failed: ")
    assert batched.k_cache.dtype == dtype and batched.k_cache.shape[-1] == batched.head_dim
    assert not any(m.exact for m in batched.modules() if isinstance(m, Linear))
    assert runner_of(target, dtype).exactness.path == exactness.PER_TOKEN
    prompts = random_ids(6, 7, 19, 3, 11, 5, 8)  # it still decodes: six rows, close to their solo logits
    prefill_ragged(batched, prompts)
    logits = batched.forward(torch.stack([p[:1] for p in prompts])).logits[:, 0]
    solo = runner_of(target, dtype)
    for row, prompt in enumerate(prompts):
        reference = solo_decode(solo, prompt, prompt[:1])[0]
        torch.testing.assert_close(logits[row], reference, rtol=0.05, atol=0.05)


@pytest.mark.real_model
@pytest.mark.parametrize("dtype", [pytest.param(torch.bfloat16, marks=native_bf16), torch.float32])
def test_real_smollm2_batched_decode_gives_each_row_its_solo_logits(smollm2, dtype):
    """SmolLM2's own shapes and weights (the probe, which test_exact_mode runs on SmolLM2, is skipped: this checks
    the batched path itself)."""
    model, _ = smollm2
    prompts = random_ids(7, 6, 41, 13, 2)
    tokens = random_ids(8, *(3,) * 4)
    solo = runner_of(model, dtype, max_seq_len=128, probe=False)
    batched = runner_of(model, dtype, rows=4, max_seq_len=128, probe=False)
    assert batched.exact and solo.exact
    prefill_ragged(batched, prompts)
    logits = torch.stack([batched.forward(torch.stack(tokens)[:, j : j + 1]).logits[:, 0] for j in range(3)], dim=1)
    for row, (prompt, row_tokens) in enumerate(zip(prompts, tokens)):
        assert torch.equal(logits[row], solo_decode(solo, prompt, row_tokens)), f"row {row}"
