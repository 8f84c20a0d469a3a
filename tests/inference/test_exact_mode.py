"""Exact mode (one row on a CPU, fp32 or bf16): a token's logits are bitwise those of decoding it alone, however it is
batched, so greedy speculative output equals AR's token for token (inference.llama.EXACT_ROWS, inference.exactness).
Every equality below compares the engine's own decode with its own chains and trees; none rests on two kernel calls
of different shapes agreeing, except where the probe checks exactly that. Every algorithm's greedy output against AR's,
on a target whose every step is a near-tie: tests/inference/test_near_ties.py."""

from __future__ import annotations

import warnings

import pytest
import torch
from eagle3_tree_builders import random_drafter as random_eagle3
from exact_helpers import DTYPES, exact_runner, rounds_differently_past
from specblock_tree_builders import random_drafter as random_specblock
from tiny_targets import tiny_llama
from transformers import LlamaForCausalLM

from core.blocks import linear as linear_module
from core.blocks.linear import Linear
from core.kernels import exact_cpu
from core.kernels.exact_cpu import KeyLists
from core.prompts import load_prompts, prompt_turns, render_prompt
from inference import drafters, exactness
from inference.algorithms import build_algorithm
from inference.exactness import tree_mask
from inference.sampling import SamplingParams

GREEDY = SamplingParams(temperature=0)


def smollm2_shaped(seed: int, layers: int) -> LlamaForCausalLM:
    """SmolLM2-135M's layer shapes (the kernels chosen depend on them) with few layers and a small vocabulary;
    sharp output distributions, so that a noisy copy agrees with it now and then."""
    return tiny_llama(
        seed,
        vocab=4096,
        layers=layers,
        temperature_scale=30.0,
        hidden=576,
        intermediate=1536,
        heads=9,
        kv_heads=3,
        max_positions=1024,
    )


def noisy_copy(model: LlamaForCausalLM, noise: float) -> LlamaForCausalLM:
    """A draft that agrees with ``model`` often but not always: each weight moved by ``noise`` of its spread."""
    copy = smollm2_shaped(0, layers=model.config.num_hidden_layers)
    copy.load_state_dict(model.state_dict())
    generator = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for param in copy.parameters():
            param.add_(noise * float(param.std()) * torch.randn(param.shape, generator=generator))
    return copy


@pytest.fixture(scope="module")
def target():
    return smollm2_shaped(0, layers=2)


@pytest.fixture
def fresh_probe(monkeypatch):
    """The probe's per-process results, emptied for this test and restored after it."""
    monkeypatch.setattr(exactness, "_results", {})


def test_the_mode_is_on_for_cpu_rows_in_fp32_and_bf16_only(target):
    for dtype in (torch.float32, torch.bfloat16):
        runner = exact_runner(target, dtype)
        assert runner.exact and runner.exactness.path == exactness.EXACT and runner.exactness.bitwise
    batched = exact_runner(target, max_batch_size=4)  # batches too (tests/inference/test_exact_batch.py)
    assert batched.exact and batched.exactness.path == exactness.EXACT and batched.exactness.bitwise
    assert not exact_runner(target, torch.float16, max_seq_len=64).exact
    assert exact_runner(target, exact=False).exactness.reason == "exact mode is off"
    with pytest.raises(ValueError, match="exact=true is not possible here: it computes in fp32 or bf16"):
        exact_runner(target, torch.float16, exact=True, max_batch_size=2)


@pytest.mark.parametrize("dtype", DTYPES)
def test_the_probe_passes_on_this_host(target, dtype, smollm2):
    """A host whose kernels break the fast path's assumption fails here loudly (the runner would still be exact,
    token by token, but this suite's speed figures and CI assume the fast path)."""
    model, _ = smollm2
    for runner in (exact_runner(target, dtype), exact_runner(model, dtype, max_seq_len=256)):
        assert runner.exactness.path == exactness.EXACT, runner.exactness.summary()
        assert runner.exactness.probe == "passed"


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("prompt_len", [57, 505])  # 505 + 100 crosses 512 cached tokens
def test_logits_do_not_depend_on_how_tokens_are_batched(target, dtype, prompt_len):
    runner = exact_runner(target, dtype)
    generator = torch.Generator().manual_seed(prompt_len)
    prompt = torch.randint(0, 4096, (1, prompt_len), generator=generator)
    tokens = torch.randint(0, 4096, (1, 100), generator=generator)
    runner.reset(1)
    runner.forward(prompt)
    start = runner.length()
    stepwise = torch.cat([runner.forward(tokens[:, j : j + 1]).logits[0] for j in range(100)])
    for block in (2, 3, 4, 5, 13, 33, 48, 64, 65, 100):  # 65, 100: more than EXACT_ROWS, run in chunks
        runner.truncate(start)
        blocked = torch.cat([runner.forward(tokens[:, j : j + block]).logits[0] for j in range(0, 100, block)])
        assert torch.equal(blocked, stepwise), f"block {block}"
    runner.truncate(start)  # the same chain through an explicit mask (the tree / grid path)
    chain = runner.forward(tokens[:, :48], attention_mask=torch.ones(48, 48, dtype=torch.bool).tril()).logits[0]
    assert torch.equal(chain, stepwise[:48])


@pytest.mark.parametrize("dtype", DTYPES)
def test_prefill_chunk_edges_do_not_change_the_cache(target, dtype):
    """A prompt prefilled at once (chunks of 64, 64, 2) or in other pieces leaves the same cache: the next tokens
    decode to the same logits."""
    runner = exact_runner(target, dtype)
    generator = torch.Generator().manual_seed(4)
    prompt = torch.randint(0, 4096, (1, 130), generator=generator)
    tokens = torch.randint(0, 4096, (1, 6), generator=generator)
    outcomes = []
    for pieces in ((130,), (63, 67), (1, 64, 65), (100, 30)):
        runner.reset(1)
        at = 0
        for size in pieces:
            runner.forward(prompt[:, at : at + size])
            at += size
        outcomes.append(torch.cat([runner.forward(tokens[:, j : j + 1]).logits[0] for j in range(6)]))
    assert all(torch.equal(o, outcomes[0]) for o in outcomes[1:])


@pytest.mark.parametrize("dtype", DTYPES)
def test_a_long_prefill_equals_decoding_its_prompt_token_by_token(dtype):
    """A 200-token prompt prefilled in one forward gives every position the logits, and the cache every slot, that
    decoding the prompt one token at a time (AR's path) gives: however the prefill is tiled (chunks, attention
    units and key blocks), no bit moves. Heads of 64 (the kernels' AVX2 paths), 3 query heads per key head."""
    model = tiny_llama(6, vocab=512, layers=1, hidden=192, intermediate=256, heads=3, kv_heads=1)
    runner = exact_runner(model, dtype, max_seq_len=208, probe=False)  # the chunked path, probed or not
    assert runner.exactness.path == exactness.EXACT
    prompt = torch.randint(0, 512, (1, 200), generator=torch.Generator().manual_seed(5))
    runner.reset(1)
    prefilled = runner.forward(prompt).logits[0]
    keys, values = runner.k_cache[:, 0, ..., :200].clone(), runner.v_cache[:, 0, :, :200].clone()
    runner.reset(1)
    decoded = torch.cat([runner.forward(prompt[:, j : j + 1]).logits[0] for j in range(200)])
    assert torch.equal(prefilled, decoded)
    assert torch.equal(keys, runner.k_cache[:, 0, ..., :200]) and torch.equal(values, runner.v_cache[:, 0, :, :200])


def random_parents(generator: torch.Generator, nodes: int) -> list[int]:
    """A random tree in topological order (each node's parent comes before it; -1: a root below the cache)."""
    return [-1] + [int(torch.randint(0, i, (1,), generator=generator)) for i in range(1, nodes)]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("cached", [70, 122, 250])  # 122 and 250: 58 past a multiple of 64, trees straddle it
def test_random_tree_nodes_get_the_logits_of_decoding_their_own_path(target, dtype, cached):
    """Tree nodes sit in slots with gaps between ancestors; each node's logits must be bitwise those of decoding
    its path token by token (what AR computes), or a tree's greedy output could leave AR's."""
    runner = exact_runner(target, dtype)
    generator = torch.Generator().manual_seed(cached)
    prompt = torch.randint(0, 4096, (1, cached), generator=generator)
    parents = random_parents(generator, 20)
    tokens = torch.randint(0, 4096, (1, len(parents)), generator=generator)
    mask, depth = tree_mask(parents)
    runner.reset(1)
    runner.forward(prompt)
    tree = runner.forward(tokens, attention_mask=mask, positions=torch.tensor([depth]) + cached).logits[0]
    for node in range(len(parents)):
        runner.truncate(cached)
        for i in mask[node].nonzero()[:, 0].tolist():
            decoded = runner.forward(tokens[:, i : i + 1]).logits[0, -1]
        assert torch.equal(tree[node], decoded), f"node {node} of {parents}"


@pytest.mark.parametrize("dtype", DTYPES)
def test_committing_a_tree_path_leaves_the_cache_decoding_would(target, dtype):
    runner = exact_runner(target, dtype)
    generator = torch.Generator().manual_seed(9)
    prompt = torch.randint(0, 4096, (1, 90), generator=generator)
    parents = [-1, 0, 0, 1, 2, 3, 3, 6]
    tokens = torch.randint(0, 4096, (1, len(parents)), generator=generator)
    nxt = torch.randint(0, 4096, (1, 1), generator=generator)
    mask, depth = tree_mask(parents)
    path = mask[7].nonzero()[:, 0].tolist()  # 0, 1, 3, 6, 7
    runner.reset(1)
    runner.forward(prompt)
    runner.forward(tokens, attention_mask=mask, positions=torch.tensor([depth]) + 90)
    runner.commit([path])
    after_tree = runner.forward(nxt).logits[0, -1]
    runner.truncate(90)
    for i in path:
        runner.forward(tokens[:, i : i + 1])
    assert torch.equal(after_tree, runner.forward(nxt).logits[0, -1])


@pytest.mark.real_model
@pytest.mark.parametrize("dtype", DTYPES)
def test_real_smollm2_tree_nodes_get_the_logits_of_decoding_their_own_path(smollm2, dtype):
    """The same on the real model, with real text in the tree."""
    model, tokenizer = smollm2
    runner = exact_runner(model, dtype, max_seq_len=512)
    prompt = render_prompt(tokenizer, prompt_turns(load_prompts("gsm_symbolic", n=3)[2]))
    answer = build_algorithm("ar", runner).generate(prompt, max_new_tokens=60, sampling=GREEDY).tokens
    parents = [-1, 0, 0, 1, 1, 2, 3, 3, 5, 6, 2, 10, 11, 4]
    mask, depth = tree_mask(parents)
    context = prompt + answer[:50]
    tokens = torch.tensor([[answer[50 + d] if i % 3 else answer[40 + i] for i, d in enumerate(depth)]])
    runner.reset(1)
    runner.forward(torch.tensor([context]))
    tree = runner.forward(tokens, attention_mask=mask, positions=torch.tensor([depth]) + len(context)).logits[0]
    for node in range(len(parents)):
        runner.truncate(len(context))
        for i in mask[node].nonzero()[:, 0].tolist():
            decoded = runner.forward(tokens[:, i : i + 1]).logits[0, -1]
        assert torch.equal(tree[node], decoded), f"node {node}"


# -- a host whose kernels differ, emulated ---------------------------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES)
def test_the_probe_catches_gemm_rows_that_depend_on_the_row_count_and_falls_back(
    target, dtype, monkeypatch, fresh_probe
):
    monkeypatch.setattr(Linear, "forward", rounds_differently_past(4))
    with pytest.warns(
        exactness.ExactnessWarning,
        match="exact mode: the lm_head on 5 hidden rows gave row 0 other "
        "logits than on it alone on this CPU; .*token by token",
    ):
        runner = exact_runner(target, dtype)
    assert runner.exactness.path == exactness.PER_TOKEN and runner.exactness.bitwise
    assert runner.exactness.probe.startswith("failed: the lm_head on 5 hidden rows")
    prompt = torch.randint(0, 4096, (30,), generator=torch.Generator().manual_seed(2)).tolist()
    reference = build_algorithm("ar", runner).generate(prompt, max_new_tokens=30, sampling=GREEDY)
    draft = exact_runner(noisy_copy(target, 0.05), dtype, exact=False)
    result = build_algorithm("sps", exact_runner(target, dtype), draft).generate(
        prompt, max_new_tokens=30, sampling=GREEDY
    )
    assert result.tokens == reference.tokens and result.stats.tau > 1.5
    # Without the probe the fast path's claim would be false on this host: a verified block differs from decoding.
    unprobed = exact_runner(target, dtype, probe=False)
    unprobed.reset(1)
    unprobed.forward(torch.tensor([prompt]))
    tokens = torch.tensor([reference.tokens[:8]])
    blocked = unprobed.forward(tokens).logits[0]
    unprobed.truncate(len(prompt))
    assert not torch.equal(blocked, torch.cat([unprobed.forward(tokens[:, j : j + 1]).logits[0] for j in range(8)]))


def test_the_probe_catches_attention_rows_that_depend_on_the_call(target, monkeypatch, fresh_probe):
    """The same for attention: a host (emulated) where a token verified among others gets other bits."""
    original = exact_cpu.attention

    def attention(q, keys_t, values, keys, threads=None):
        out = original(q, keys_t, values, keys, threads)
        return out if q.shape[0] == 1 else (out.view(torch.int32) ^ 1).view(torch.float32)

    monkeypatch.setattr(exact_cpu, "attention", attention)
    with pytest.warns(exactness.ExactnessWarning, match="a block of 2 tokens"):
        runner = exact_runner(target, torch.float32)
    assert runner.exactness.path == exactness.PER_TOKEN
    prompt = torch.randint(0, 4096, (20,), generator=torch.Generator().manual_seed(1)).tolist()
    reference = build_algorithm("ar", runner).generate(prompt, max_new_tokens=12, sampling=GREEDY)
    assert (
        build_algorithm("self_draft", runner).generate(prompt, max_new_tokens=12, sampling=GREEDY).tokens
        == reference.tokens
    )


def flipped_last_bit(out: torch.Tensor) -> torch.Tensor:
    bits = out.view(torch.int16) if out.dtype == torch.bfloat16 else out.view(torch.int32)
    return (bits ^ 1).view(out.dtype)


def rounds_differently_at(rows: int, *, head: bool):
    """Linear.forward as on a host whose GEMM rounds a call of exactly ``rows`` rows differently, in the lm_head
    only (``head``: a module with the target's 4096 outputs) or in the decoder's linears only."""
    original = Linear.forward

    def forward(self, x, out_features=None):
        out = original(self, x, out_features)
        hit = x.numel() // x.shape[-1] == rows and (self.out_features == 4096) == head
        return flipped_last_bit(out) if hit else out

    return forward


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(
    "rows, head, found",
    [
        (7, False, "a block of 7 tokens gave token 0 other hidden states than decoding it alone"),
        (27, True, "the lm_head on 27 hidden rows gave row 0 other logits than on it alone"),
    ],
)
def test_the_probe_catches_rows_that_differ_only_at_a_count_it_once_skipped(
    target, dtype, rows, head, found, monkeypatch, fresh_probe
):
    """Served row counts (a 7-token chain, the 27-row tail of a 91-row tree) that the probe's former sample of
    blocks (2, 3, 5, 13, 33, 48, 64 and their tails) never tried: every count 1..EXACT_ROWS is checked now."""
    monkeypatch.setattr(Linear, "forward", rounds_differently_at(rows, head=head))
    with pytest.warns(exactness.ExactnessWarning, match=f"exact mode: {found} on this CPU"):
        runner = exact_runner(target, dtype)
    assert runner.exactness.path == exactness.PER_TOKEN and runner.exactness.bitwise


def one_row_head_rounds_differently(vocab: int):
    """Linear.forward as on a host whose one-row lm_head call gives other logits than the same row among others:
    each id's logit moved by a fixed pattern of about the logits' spread (a deterministic function of the call, as
    a kernel's other blocking is, and large enough to move greedy choices)."""
    original = Linear.forward
    pattern = torch.randn(vocab, generator=torch.Generator().manual_seed(11))

    def forward(self, x, out_features=None):
        out = original(self, x, out_features)
        if self.out_features != vocab or x.numel() // x.shape[-1] != 1:
            return out
        return out + (pattern[: out.shape[-1]] * 3 * out.float().std()).to(out.dtype)

    return forward


@pytest.mark.parametrize("dtype", DTYPES)
def test_a_host_whose_one_row_lm_head_differs_cannot_move_verification_rows_off_ars(dtype, monkeypatch, fresh_probe):
    """Verification rows computed after the forward (eagle3_tree, specblock_tree, Self-Draft) take the runner's
    logits_from_hidden, AR's own path. In fp32 AR's head call has one row, so the probe sees it differ from the same
    row among others and falls back to token by token; in bf16 no call has one row (a lone row is doubled), so the
    fast path stands, though a bare one-row lm_head call (how those rows were once computed) gives other logits.
    Either way every algorithm's greedy output is AR's."""
    model = smollm2_shaped(0, layers=3)  # the drafters' test helpers read aux layers 0, 1, 2
    monkeypatch.setattr(Linear, "forward", one_row_head_rounds_differently(4096))
    if dtype == torch.float32:
        with pytest.warns(exactness.ExactnessWarning, match="the lm_head on 2 hidden rows gave row 0 other logits"):
            runner = exact_runner(model, dtype)
        assert runner.exactness.path == exactness.PER_TOKEN
    else:
        runner = exact_runner(model, dtype)
        assert runner.exactness.path == exactness.EXACT
        hidden = runner.forward(torch.tensor([[5, 6, 7]]), return_last_hidden=True).last_hidden[0, -1:]
        assert not torch.equal(runner.lm_head(hidden).float(), runner.logits_from_hidden(hidden))
    prompt = torch.randint(0, 4096, (12,), generator=torch.Generator().manual_seed(5)).tolist()
    reference = build_algorithm("ar", runner).generate(prompt, max_new_tokens=10, sampling=GREEDY).tokens
    drafters = {
        "eagle3_tree": (random_eagle3(model, draft_vocab=512).to(dtype), {"tree_total": 8}),
        "specblock_tree": (random_specblock(model, draft_vocab=512).to(dtype), {}),
        "self_draft": (None, {"branch_len": 3, "branch_num": 2}),
    }
    for name, (drafter, options) in drafters.items():
        built = build_algorithm(name, exact_runner(model, dtype), drafter, **options)
        assert built.generate(prompt, max_new_tokens=10, sampling=GREEDY).tokens == reference, name


def test_a_host_that_is_not_even_deterministic_is_reported_as_approximate(target, monkeypatch, fresh_probe):
    calls = iter(range(10**9))
    original = Linear.forward

    def noisy(self, x, out_features=None):  # every call rounds its own way
        out = original(self, x, out_features)
        return out if next(calls) % 2 else (out.view(torch.int32) ^ 1).view(torch.float32)

    monkeypatch.setattr(Linear, "forward", noisy)
    with pytest.warns(exactness.ExactnessWarning, match="greedy equality only up to rounding"):
        runner = exact_runner(target, torch.float32)
    assert runner.exactness.path == exactness.APPROXIMATE and not runner.exactness.bitwise
    assert not runner.exact  # it runs the plain path and claims nothing
    assert "up to rounding" in runner.exactness.summary()


def test_without_the_kernels_the_mode_is_off_and_says_why(target, monkeypatch):
    def unavailable():
        raise exact_cpu.KernelUnavailable("no C compiler found for the exact CPU kernels; install gcc")

    monkeypatch.setattr(exact_cpu, "library", unavailable)
    with pytest.warns(exactness.ExactnessWarning, match="exact mode is off: no C compiler found"):
        runner = exact_runner(target, torch.float32)
    assert not runner.exact and runner.exactness.path == exactness.APPROXIMATE
    prompt = torch.randint(0, 4096, (20,), generator=torch.Generator().manual_seed(1)).tolist()
    assert len(build_algorithm("ar", runner).generate(prompt, max_new_tokens=4, sampling=GREEDY).tokens) == 4


# -- the kernels --------------------------------------------------------------------------------------------------


def test_the_attention_kernel_matches_fp64_and_each_row_is_its_own(target):
    torch.manual_seed(0)
    kv_heads, group, dim, slots, cached, new = 3, 3, 64, 1104, 1000, 21
    keys_t, values = torch.randn(kv_heads, dim, slots), torch.randn(kv_heads, slots, dim)
    q = torch.randn(new, kv_heads * group, dim)
    out = exact_cpu.attention(q, keys_t, values, KeyLists.chain(cached, new))
    k, v = keys_t.double().transpose(1, 2).repeat_interleave(group, 0), values.double().repeat_interleave(group, 0)
    for t in (0, 9, 20):
        n = cached + t + 1
        scores = (q[t].double()[:, None] @ k[:, :n].transpose(1, 2))[:, 0] * dim**-0.5
        reference = (scores.softmax(-1)[:, None] @ v[:, :n])[:, 0]
        assert (out[t].double() - reference).abs().max() < 2e-6
        alone = exact_cpu.attention(q[t : t + 1], keys_t, values, KeyLists.chain(cached + t, 1), threads=1)
        assert torch.equal(alone[0], out[t])  # one thread or two, alone or among 21: the same bits


def test_key_lists_follow_the_mask_in_path_order():
    allowed = torch.zeros(4, 12, dtype=torch.bool)
    allowed[:, :8] = True
    for node, parent in enumerate([-1, 0, 0, 2]):
        allowed[node, 8 + node] = True
        if parent >= 0:
            allowed[node] |= allowed[parent]
    keys = KeyLists.from_mask(allowed)
    assert keys.prefix.tolist() == [9, 10, 9, 9] and keys.offsets.tolist() == [0, 0, 0, 1, 3]
    assert keys.extra.tolist() == [10, 10, 11] and keys.longest == 11
    chain = KeyLists.chain(5, 3)
    assert chain.prefix.tolist() == [6, 7, 8] and chain.longest == 8


def test_the_kernels_refuse_what_they_cannot_take():
    with pytest.raises(ValueError, match="bf16 or fp32 CPU tensors, got torch.float16"):
        exact_cpu.silu(torch.ones(4, dtype=torch.float16))
    with pytest.raises(ValueError, match="a key list reaches past the cache"):
        exact_cpu.attention(torch.ones(1, 2, 16), torch.ones(1, 16, 16), torch.ones(1, 16, 16), KeyLists.chain(16, 1))
    with pytest.raises(ValueError, match="keys_t must be fp32"):
        exact_cpu.attention(torch.ones(1, 2, 16), torch.ones(1, 16, 20), torch.ones(1, 20, 16), KeyLists.chain(1, 1))


def test_dtype_names_are_checked(monkeypatch):
    assert drafters.model_dtype("auto", "cpu") is None
    assert drafters.model_dtype("fp32", "cpu") is torch.float32
    with pytest.raises(ValueError, match="dtype=fp8 is not supported; use auto, fp32 or bf16"):
        drafters.model_dtype("fp8", "cpu")
    monkeypatch.setattr(drafters, "cpu_has_native_bf16", lambda: False)
    with pytest.raises(ValueError, match="needs a CPU with native bf16.*use dtype=fp32"):
        drafters.model_dtype("bf16", "cpu")


def test_packed_bf16_linear_equals_f_linear_and_follows_weight_updates():
    torch.manual_seed(0)
    layer = Linear(64, 96, bias=True).to(torch.bfloat16).requires_grad_(False)
    x = torch.randn(5, 64).to(torch.bfloat16)
    assert torch.equal(layer(x), torch.nn.functional.linear(x, layer.weight, layer.bias))
    assert torch.equal(layer(x, 40), torch.nn.functional.linear(x, layer.weight[:40], layer.bias[:40]))
    with torch.no_grad():
        layer.weight.mul_(2)  # an in-place update (the adapter's kind): the packed copy is rebuilt
    assert torch.equal(layer(x), torch.nn.functional.linear(x, layer.weight, layer.bias))
    assert "_packs" not in layer.state_dict() and set(layer.state_dict()) == {"weight", "bias"}
    layer.requires_grad_(True)  # training (the serving-time adapter updates bf16 drafters): F.linear, with a backward
    layer(x).sum().backward()
    assert layer.weight.grad is not None and layer.weight.grad.shape == layer.weight.shape


def test_the_exact_fp32_linear_gives_each_row_the_same_bits_whatever_the_call():
    torch.manual_seed(0)
    layer = Linear(70, 100).requires_grad_(False)  # neither a multiple of 16: padded columns, a k tail
    layer.exact = True
    x = torch.randn(64, 70)
    with torch.no_grad():
        full = layer(x)
        torch.testing.assert_close(full, torch.nn.functional.linear(x, layer.weight, layer.bias), rtol=1e-5, atol=1e-5)
        for rows in (1, 2, 3, 5, 13, 33, 48):
            assert torch.equal(layer(x[:rows]), full[:rows]), rows
        assert torch.equal(layer(x[17:18]), full[17:18])
        assert torch.equal(layer(x[:7], 40), full[:7, :40])  # a vocabulary-limited head
        layer.weight.mul_(2)  # an in-place update: the transposed copy is rebuilt
        torch.testing.assert_close(
            layer(x[:3]), torch.nn.functional.linear(x[:3], layer.weight, layer.bias), rtol=1e-5, atol=1e-5
        )


def test_warnings_name_one_line(target, monkeypatch, fresh_probe):
    """Each warning the mode gives is a single line (no traceback-like spill)."""
    monkeypatch.setattr(Linear, "forward", rounds_differently_past(4))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        exact_runner(target, torch.float32)
    messages = [str(w.message) for w in caught if issubclass(w.category, exactness.ExactnessWarning)]
    assert len(messages) == 1 and "\n" not in messages[0]


def test_bf16_without_onednn_bf16_runs_the_exact_fp32_kernel_row_by_row(monkeypatch):
    """A CPU whose oneDNN has no bf16 linear (AVX2 only): exact mode's bf16 linear is the fp32 kernel on the bf16
    values, so each row's bits do not depend on the call; the plain path stays F.linear."""
    monkeypatch.setattr(linear_module, "ONEDNN_BF16", False)
    generator = torch.Generator().manual_seed(0)
    layer = Linear(96, 40, bias=True).to(torch.bfloat16).requires_grad_(False)
    layer.exact = True
    x = torch.randn(9, 96, generator=generator).to(torch.bfloat16)
    together = layer(x)
    alone = torch.cat([layer(x[i : i + 1]) for i in range(len(x))])
    assert together.dtype == torch.bfloat16 and torch.equal(together, alone)
    reference = (x.double() @ layer.weight.double().t() + layer.bias.double()).to(torch.bfloat16)
    assert (together.float() - reference.float()).abs().max() <= 2**-6 * reference.float().abs().max()
    layer.exact = False
    assert torch.equal(layer(x), torch.nn.functional.linear(x, layer.weight, layer.bias))
