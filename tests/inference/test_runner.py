"""Runners (inference/runner.py) against transformers' own forward on tiny random models.

Tolerance: fp32 on CPU, logits and hidden states equal to transformers within atol=1e-4 (observed ~1e-7).
"""

from functools import cache

import pytest
import torch
from transformers import (
    GPT2Config,
    GPT2LMHeadModel,
    LlamaConfig,
    LlamaForCausalLM,
    MistralConfig,
    MistralForCausalLM,
    Qwen2Config,
    Qwen2ForCausalLM,
    Qwen3Config,
    Qwen3ForCausalLM,
)

from inference.runner import ModelRunner

from inference.runner_contract import RunnerOutput

from inference.runner_loading import load_runner

from inference.transformers_runner import TransformersRunner

ATOL = 1e-4
VOCAB = 128
MAX_SEQ = 64
TINY = {
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "vocab_size": VOCAB,
    "max_position_embeddings": 128,
}
ARCHS = {
    "llama": (LlamaForCausalLM, lambda: LlamaConfig(**TINY, num_hidden_layers=2, tie_word_embeddings=False)),
    "llama3_rope_tied": (
        LlamaForCausalLM,
        lambda: LlamaConfig(
            **TINY,
            num_hidden_layers=3,
            tie_word_embeddings=True,
            rope_parameters={
                "rope_type": "llama3",
                "rope_theta": 500000.0,
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 16,
            },
        ),
    ),
    # Default sliding_window 4096 >= max_seq_len: no effect, so accepted.
    "mistral": (MistralForCausalLM, lambda: MistralConfig(**TINY, num_hidden_layers=2, head_dim=32)),
    "qwen2_bias_tied": (
        Qwen2ForCausalLM,
        lambda: Qwen2Config(**TINY, num_hidden_layers=2, tie_word_embeddings=True),
    ),
    "qwen3_qknorm": (Qwen3ForCausalLM, lambda: Qwen3Config(**TINY, num_hidden_layers=2, head_dim=32)),
}
GPT2 = (
    GPT2LMHeadModel,
    lambda: GPT2Config(
        n_embd=64, n_layer=2, n_head=4, vocab_size=VOCAB, n_positions=128, bos_token_id=0, eos_token_id=0
    ),
)
# (arch, runner kind): every native arch through both runners, GPT-2 through TransformersRunner only.
CASES = [(arch, kind) for arch in ARCHS for kind in ("native", "transformers")] + [("gpt2", "transformers")]


@cache
def hf_model(arch: str):
    model_cls, make_config = GPT2 if arch == "gpt2" else ARCHS[arch]
    torch.manual_seed(0)
    model = model_cls(make_config()).eval()
    # transformers initialises norms to 1 and biases to 0; perturb them so they are actually tested.
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("bias"):
                param.normal_(0.0, 0.1)
            elif "norm" in name or "ln_" in name:
                param.add_(torch.randn_like(param) * 0.1)
    return model


def make_runner(arch: str, kind: str, batch: int = 1, max_seq_len: int = MAX_SEQ):
    model = hf_model(arch)
    if kind == "native":
        return ModelRunner.from_hf_model(model, max_batch_size=batch, max_seq_len=max_seq_len)
    return TransformersRunner(model, max_batch_size=batch, max_seq_len=max_seq_len)


def tokens(*shape: int, seed: int = 1) -> torch.Tensor:
    return torch.randint(0, VOCAB, shape, generator=torch.Generator().manual_seed(seed))


@torch.no_grad()
def reference(arch: str, ids: torch.Tensor, **kw):
    """transformers' own forward (full causal, no cache) on a [T] or [1, T] sequence."""
    return hf_model(arch)(ids.view(1, -1), **kw)


def assert_close(actual: torch.Tensor, expected: torch.Tensor) -> None:
    torch.testing.assert_close(actual, expected.to(actual.dtype), atol=ATOL, rtol=0)


# Tree over 6 new tokens (parents index into the tree, -1 = child of the cached prefix):
#   0 -> 1 -> 3, 0 -> 1 -> 4, 0 -> 2 -> 5
TREE_PARENTS = [-1, 0, 0, 1, 1, 2]


def tree_paths(parents: list[int]) -> list[list[int]]:
    paths = []
    for node, parent in enumerate(parents):
        paths.append((paths[parent] if parent >= 0 else []) + [node])
    return paths


def tree_mask(parents: list[int]) -> torch.Tensor:
    """[T, T] ancestor-or-self mask."""
    size = len(parents)
    mask = torch.zeros(size, size, dtype=torch.bool)
    for node, path in enumerate(tree_paths(parents)):
        mask[node, path] = True
    return mask


# ----------------------------------------------------------------------------------------------------------
# Equality with transformers


@pytest.mark.parametrize("arch,kind", CASES)
def test_prefill_decode_and_chunk_match_transformers(arch, kind):
    runner = make_runner(arch, kind)
    seq = tokens(14)
    expected = reference(arch, seq).logits[0]
    out = runner.forward(seq[None, :6])
    assert isinstance(out, RunnerOutput) and out.logits.dtype == torch.float32
    assert_close(out.logits[0], expected[:6])  # prefill in one go
    for t in range(6, 9):  # token-by-token decode
        assert_close(runner.forward(seq[None, t : t + 1]).logits[0, 0], expected[t])
    assert_close(runner.forward(seq[None, 9:14]).logits[0], expected[9:14])  # a chunk of several tokens
    assert runner.lengths == [14]


@pytest.mark.parametrize("arch,kind", CASES)
def test_tree_forward_then_commit_branch_then_decode(arch, kind):
    runner = make_runner(arch, kind)
    prefix, nodes, more = tokens(5, seed=2), tokens(len(TREE_PARENTS), seed=3), tokens(3, seed=4)
    runner.forward(prefix[None])
    paths = tree_paths(TREE_PARENTS)
    depth = torch.tensor([len(path) - 1 for path in paths])
    out = runner.forward(nodes[None], positions=(5 + depth)[None], attention_mask=tree_mask(TREE_PARENTS)[None])
    for node, path in enumerate(paths):  # each node sees exactly its root-to-node path
        expected = reference(arch, torch.cat([prefix, nodes[path]])).logits[0, -1]
        assert_close(out.logits[0, node], expected)

    kept = paths[5]  # [0, 2, 5]: a branch that is not a prefix of the tree order
    runner.commit(torch.tensor([kept]))
    assert runner.lengths == [5 + len(kept)]
    committed = torch.cat([prefix, nodes[kept], more])
    expected = reference(arch, committed).logits[0]
    assert_close(runner.forward(more[None, :1]).logits[0, 0], expected[8])
    assert_close(runner.forward(more[None, 1:]).logits[0], expected[9:])


@pytest.mark.parametrize("arch,kind", CASES)
def test_full_form_mask_with_cache_columns(arch, kind):
    """The [B, T, P + T] mask form equals the short form when all cache columns are True."""
    runner = make_runner(arch, kind)
    prefix, nodes = tokens(4, seed=5), tokens(len(TREE_PARENTS), seed=6)
    runner.forward(prefix[None])
    full = torch.cat([torch.ones(len(TREE_PARENTS), 4, dtype=torch.bool), tree_mask(TREE_PARENTS)], dim=1)
    depth = torch.tensor([len(path) - 1 for path in tree_paths(TREE_PARENTS)])
    out = runner.forward(nodes[None], positions=4 + depth, attention_mask=full)
    expected = reference(arch, torch.cat([prefix, nodes[[0, 2, 5]]])).logits[0, -1]
    assert_close(out.logits[0, 5], expected)


@pytest.mark.parametrize("arch,kind", CASES)
def test_truncate_then_continue(arch, kind):
    runner = make_runner(arch, kind)
    seq, other = tokens(10, seed=7), tokens(3, seed=8)
    runner.forward(seq[None])
    runner.truncate(6)
    assert runner.lengths == [6]
    expected = reference(arch, torch.cat([seq[:6], other])).logits[0]
    assert_close(runner.forward(other[None]).logits[0], expected[6:])
    runner.reset()
    assert runner.lengths == [0]
    assert_close(runner.forward(seq[None, :4]).logits[0], reference(arch, seq[:4]).logits[0])


@pytest.mark.parametrize("arch,kind", CASES)
def test_batch_rows_with_different_lengths_match_per_row(arch, kind):
    runner = make_runner(arch, kind, batch=2)
    prompts = tokens(2, 7, seed=9)
    runner.forward(prompts)
    runner.truncate(torch.tensor([4, 7]))  # row 0 keeps a 4-token prompt, row 1 a 7-token one
    rows = [prompts[0, :4], prompts[1]]
    decode, chunk = tokens(2, 1, seed=10), tokens(2, 3, seed=11)
    out_decode = runner.forward(decode)
    out_chunk = runner.forward(chunk)
    for b in range(2):
        expected = reference(arch, torch.cat([rows[b], decode[b], chunk[b]])).logits[0]
        n = len(rows[b])
        assert_close(out_decode.logits[b, 0], expected[n])
        assert_close(out_chunk.logits[b], expected[n + 1 :])
    assert runner.lengths == [8, 11]

    # A tree per row, then per-row commits of different lengths (list form).
    nodes = tokens(2, len(TREE_PARENTS), seed=12)
    paths = tree_paths(TREE_PARENTS)
    depth = torch.tensor([len(path) - 1 for path in paths])
    positions = torch.tensor([[8], [11]]) + depth
    out = runner.forward(nodes, positions=positions, attention_mask=tree_mask(TREE_PARENTS))
    rows = [torch.cat([rows[b], decode[b], chunk[b]]) for b in range(2)]
    for b in range(2):
        for node, path in enumerate(paths):
            expected = reference(arch, torch.cat([rows[b], nodes[b, path]])).logits[0, -1]
            assert_close(out.logits[b, node], expected)
    kept = [[0, 1, 4], [0, 2]]
    runner.commit(kept)
    assert runner.lengths == [11, 13]
    last = tokens(2, 1, seed=13)
    out = runner.forward(last)
    for b in range(2):
        expected = reference(arch, torch.cat([rows[b], nodes[b, kept[b]], last[b]])).logits[0, -1]
        assert_close(out.logits[b, 0], expected)


@pytest.mark.parametrize("arch,kind", CASES)
def test_hidden_capture_convention(arch, kind):
    runner = make_runner(arch, kind)
    seq = tokens(9, seed=14)
    num_layers = runner.num_layers
    ref = reference(arch, seq, output_hidden_states=True)
    runner.forward(seq[None, :5])
    out = runner.forward(seq[None, 5:], capture_layers=(0, -1), return_last_hidden=True)
    assert sorted(out.hidden) == [0, num_layers - 1]
    # Layer i's output is transformers' hidden_states[i + 1] ...
    assert_close(out.hidden[0][0], ref.hidden_states[1][0, 5:])
    # ... except the last layer, where transformers stores the final-normed state: we keep the raw output.
    assert_close(runner.norm(out.hidden[num_layers - 1])[0], ref.hidden_states[num_layers][0, 5:])
    assert_close(out.last_hidden[0], ref.hidden_states[-1][0, 5:])
    assert_close(runner.lm_head(out.last_hidden).float(), out.logits)


# ----------------------------------------------------------------------------------------------------------
# Runners agree with each other on arbitrary masks (cache columns hidden, rows of different lengths)


@pytest.mark.parametrize("arch", ["llama", "qwen3_qknorm"])
def test_runners_agree_on_random_mask_over_cache(arch):
    native, fallback = make_runner(arch, "native", batch=2), make_runner(arch, "transformers", batch=2)
    prompts, new = tokens(2, 6, seed=15), tokens(2, 4, seed=16)
    generator = torch.Generator().manual_seed(17)
    mask = torch.rand(2, 4, 6 + 4, generator=generator) < 0.6
    positions = torch.tensor([[3, 4, 4, 5], [6, 6, 7, 8]])
    outputs = []
    for runner in (native, fallback):
        runner.forward(prompts)
        runner.truncate(torch.tensor([3, 6]))
        outputs.append(runner.forward(new, positions=positions, attention_mask=mask).logits)
    assert_close(outputs[0], outputs[1])
    # Hidden cache columns matter: the result differs from the all-visible cache.
    native.truncate(torch.tensor([3, 6]))
    visible = mask.clone()
    visible[:, :, :6] = True
    assert not torch.allclose(native.forward(new, positions=positions, attention_mask=visible).logits, outputs[0])


# ----------------------------------------------------------------------------------------------------------
# Construction and errors


def test_from_config_with_state_dict_and_only_last_logits():
    model = hf_model("llama")
    runner = ModelRunner.from_config(model.config, model.state_dict(), max_seq_len=16)
    assert runner.dtype == torch.float32 and runner.k_cache.shape == (2, 1, 2, 16, 16)
    seq = tokens(6, seed=18)
    out = runner.forward(seq[None], only_last_logits=True)
    assert out.logits.shape == (1, 1, VOCAB)
    assert_close(out.logits[0, 0], reference("llama", seq).logits[0, -1])


@pytest.mark.parametrize("kind", ["native", "transformers"])
def test_logit_rows_returns_just_those_rows(kind):
    seq = tokens(7, seed=19)
    full = make_runner("llama", kind).forward(seq[None]).logits
    out = make_runner("llama", kind).forward(seq[None], logit_rows=slice(2, 5), return_last_hidden=True)
    assert out.logits.shape == (1, 3, VOCAB) and out.last_hidden.shape[1] == 7
    assert_close(out.logits, full[:, 2:5])
    with pytest.raises(ValueError, match="only_last_logits or logit_rows, not both"):
        make_runner("llama", kind).forward(seq[None], only_last_logits=True, logit_rows=slice(0, 1))


@pytest.mark.parametrize("kind", ["native", "transformers"])
def test_logit_vocab_scores_only_the_lowest_ids_over_shared_weights(kind):
    from inference.runner_loading import with_logit_vocab

    seq = tokens(6, seed=23)
    base = make_runner("llama", kind)
    limited = with_logit_vocab(base, 10)
    assert with_logit_vocab(base, 0) is base and with_logit_vocab(limited, 10) is limited
    assert limited.embed_tokens.weight.data_ptr() == base.embed_tokens.weight.data_ptr()  # weights not copied
    for rows in ({}, {"only_last_logits": True}, {"logit_rows": slice(1, 3)}):
        full = base.forward(seq[None], **rows).logits
        out = limited.forward(seq[None], **rows).logits
        assert out.shape == full.shape and out.dtype == torch.float32
        assert_close(out[..., :10], full[..., :10])
        assert torch.isneginf(out[..., 10:]).all()
        assert torch.isfinite(out.softmax(-1)).all() and (out.softmax(-1)[..., 10:] == 0).all()
        base.reset(), limited.reset()
    assert base.length() == limited.length() == 0
    limited.forward(seq[None])
    assert base.length() == 0 and limited.length() == 6  # caches are separate
    with pytest.raises(ValueError, match=rf"draft_vocab={VOCAB + 1} is outside 1..{VOCAB}"):
        with_logit_vocab(base, VOCAB + 1)


@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5])
def test_linear_pads_two_or_three_rows_without_changing_them(rows):
    from core.blocks.linear import Linear

    torch.manual_seed(rows)
    layer = Linear(24, 40)
    x = torch.randn(1, rows, 24)
    out = layer(x)
    assert out.shape == (1, rows, 40)
    assert torch.allclose(out, torch.nn.functional.linear(x, layer.weight, layer.bias), atol=1e-6)
    assert set(layer.state_dict()) == {"weight", "bias"}  # loads transformers' names as-is


def test_tied_embeddings_share_weight():
    runner = make_runner("qwen2_bias_tied", "native")
    assert runner.lm_head.weight is runner.embed_tokens.weight


@pytest.mark.parametrize("kind", ["native", "transformers"])
def test_overflow_raises(kind):
    runner = make_runner("llama", kind, max_seq_len=8)
    runner.forward(tokens(1, 6))
    with pytest.raises(ValueError, match="needs 9 cache slots.*max_seq_len=9"):
        runner.forward(tokens(1, 3))
    assert runner.lengths == [6]


def test_unsupported_arch_raises():
    with pytest.raises(ValueError, match="TransformersRunner"):
        ModelRunner.from_hf_model(hf_model("gpt2"))


def test_sliding_window_that_matters_raises():
    config = MistralConfig(**TINY, num_hidden_layers=1, sliding_window=16)
    with pytest.raises(ValueError, match="sliding window of 16"):
        ModelRunner.from_config(config, {}, max_seq_len=64)
    assert ModelRunner(config, device=torch.device("cpu"), dtype=torch.float32, max_batch_size=1, max_seq_len=16)


def test_commit_rejects_bad_indices_and_needs_forward():
    runner = make_runner("llama", "native")
    with pytest.raises(ValueError, match="forward"):
        runner.commit([[0]])
    runner.forward(tokens(1, 4))
    with pytest.raises(ValueError, match="increasing"):
        runner.commit([[2, 1]])
    with pytest.raises(ValueError, match="increasing"):
        runner.commit(torch.tensor([[0, 4]]))


def test_load_runner_picks_backend():
    assert isinstance(load_runner(hf_model("llama"), max_seq_len=16), ModelRunner)
    assert isinstance(load_runner(hf_model("gpt2"), max_seq_len=16), TransformersRunner)
    assert isinstance(load_runner(hf_model("llama"), backend="transformers"), TransformersRunner)


def test_select_rows_forks_and_keeps_rows_like_fresh_prefills():
    """select_rows([1, 1, 0], n): each new row continues exactly as a fresh prefill of that row's first n tokens."""
    runner = make_runner("llama", "native", batch=3)
    ids = tokens(2, 9)
    runner.reset(2)
    runner.forward(ids)
    runner.select_rows([1, 1, 0], 6)
    nxt = tokens(3, 1, seed=5)
    out = runner.forward(nxt).logits
    for row, source in enumerate([1, 1, 0]):
        fresh = make_runner("llama", "native")
        expected = fresh.forward(torch.cat([ids[source : source + 1, :6], nxt[row : row + 1]], dim=1)).logits[:, -1]
        assert_close(out[row : row + 1, -1], expected)
    with pytest.raises(ValueError, match="keeps 9 tokens but the chosen rows hold only 7"):
        runner.select_rows([0], 9)


def test_first_rows_steps_only_those_rows_and_leaves_the_rest():
    """Inside first_rows(2) a forward of 2 rows continues rows 0 and 1 as a whole-batch forward would; row 2 keeps
    its cache, and continues afterwards as if nothing had run (the serving batcher's light-load step)."""
    runner, whole = make_runner("llama", "native", batch=3), make_runner("llama", "native", batch=3)
    ids, nxt = tokens(3, 7), tokens(3, 1, seed=5)
    for r in (runner, whole):
        r.reset(3)
        r.forward(ids)
    with runner.first_rows(2):
        assert runner.batch_size == 2
        part = runner.forward(nxt[:2]).logits
    assert runner.lengths == [8, 8, 7]
    assert_close(part, whole.forward(nxt).logits[:2])
    runner.truncate(7)
    whole.truncate(7)
    assert_close(runner.forward(nxt).logits, whole.forward(nxt).logits)
    with pytest.raises(ValueError, match="outside 1..batch_size=3"):
        with runner.first_rows(4):
            pass
