"""Acceptance traces: the sps round hook is exact and free when unused; the traces CLI, its manifest and resume."""

from __future__ import annotations

import pytest
import torch
from tiny_targets import save_tiny_target, write_jsonl
from transformers import LlamaConfig, LlamaForCausalLM

from data_prep.shards import ShardReader, to_tensor
from data_prep.traces import hrad_class, main, parse_args, record_traces
from inference.algorithms.sps import RoundInfo, SpeculativeSampling
from inference.runner import ModelRunner
from inference.sampling import SamplingParams

GREEDY = SamplingParams(temperature=0)


def tiny_llama(seed: int, layers: int) -> LlamaForCausalLM:
    torch.manual_seed(seed)
    config = LlamaConfig(
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=61,
        max_position_embeddings=256,
    )
    model = LlamaForCausalLM(config).eval()
    with torch.no_grad():
        model.lm_head.weight.mul_(6.0)  # peaked distributions: the draft agrees with the target often
    return model


@pytest.fixture(scope="module")
def pair():
    target = tiny_llama(0, layers=4)
    draft = tiny_llama(0, layers=4)
    with torch.no_grad():  # a perturbed copy of the target: partial acceptance
        for p in draft.parameters():
            p.add_(0.15 * torch.randn_like(p))
    return target, draft


def sps_with_hook(target, draft, gamma=4):
    infos: list[RoundInfo] = []
    sps = SpeculativeSampling(
        ModelRunner.from_hf_model(target, max_seq_len=160),
        ModelRunner.from_hf_model(draft, max_seq_len=160),
        gamma=gamma,
        on_round=infos.append,
        round_capture_layers=[1, 2],
    )
    return sps, infos


def test_round_hook_reports_what_the_round_did(pair):
    target, draft = pair
    prompt = [3, 1, 4, 1, 5, 9, 2, 6]
    sps, infos = sps_with_hook(target, draft)
    result = sps.generate(prompt, max_new_tokens=60, sampling=GREEDY)
    tokens = result.tokens
    assert [i.index for i in infos] == list(range(result.stats.rounds))
    assert sum(i.num_accepted for i in infos) == result.stats.accepted_draft_tokens
    assert {i.num_accepted for i in infos} - {0, 4}, "want partially accepted rounds in this test"
    sequence = torch.tensor([prompt + tokens])
    with torch.no_grad():
        ref = target(sequence, output_hidden_states=True)
        draft_logits = None
    for info in infos:
        start = info.prefix_len - len(prompt)  # emitted tokens before the branch token
        n = info.num_accepted
        assert info.draft_tokens[:n] == tokens[start : start + n]  # greedy: accepted = equal to the target
        if n < len(info.draft_tokens) and start + n < len(tokens):
            assert info.draft_tokens[n] != tokens[start + n]
        before = info.prefix_len - 1  # the position whose output predicts the branch token
        for layer in (1, 2):
            torch.testing.assert_close(
                info.hidden[layer], ref.hidden_states[layer + 1][0, before], atol=1e-5, rtol=1e-4
            )
        torch.testing.assert_close(info.last_hidden, ref.hidden_states[-1][0, before], atol=1e-5, rtol=1e-4)
        # draft probabilities along its own chain (temperature 1)
        chain = torch.tensor([prompt + tokens[:start] + info.draft_tokens])
        with torch.no_grad():
            draft_logits = draft(chain).logits[0, before : before + len(info.draft_tokens)].softmax(-1)
        expected = draft_logits.gather(1, torch.tensor(info.draft_tokens)[:, None]).squeeze(1)
        torch.testing.assert_close(torch.tensor(info.draft_probs), expected, atol=1e-5, rtol=1e-4)
        torch.testing.assert_close(
            torch.tensor(info.draft_max_probs), draft_logits.max(-1).values, atol=1e-5, rtol=1e-4
        )


def test_hook_changes_nothing_about_the_output(pair):
    target, draft = pair
    plain = SpeculativeSampling(
        ModelRunner.from_hf_model(target, max_seq_len=160), ModelRunner.from_hf_model(draft, max_seq_len=160), gamma=3
    )
    hooked, infos = sps_with_hook(target, draft, gamma=3)
    sampling = SamplingParams(temperature=0.8)
    a = plain.generate([7, 8, 9], max_new_tokens=50, sampling=sampling, generator=torch.Generator().manual_seed(3))
    b = hooked.generate([7, 8, 9], max_new_tokens=50, sampling=sampling, generator=torch.Generator().manual_seed(3))
    assert a.tokens == b.tokens and a.stats.rounds == b.stats.rounds == len(infos)


def test_hrad_class():
    assert hrad_class(0, 7) is None  # branch token rejected: no surviving branch
    assert [hrad_class(n, 7) for n in (1, 2, 6, 7)] == [0, 1, 1, 2]
    assert hrad_class(3, 3) == 2


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    from inference.drafters import load_draft_lm, load_lm

    root = tmp_path_factory.mktemp("traces")
    target_dir = save_tiny_target(root / "target", layers=4)
    draft_dir = save_tiny_target(root / "draft", layers=4, noise=0.002)  # agrees with the target in part
    prompts = write_jsonl(root / "chats.jsonl", 6)
    long_prompt = '{"prompt": "' + "word " * 200 + '"}\n'  # cannot fit max_seq_len: skipped
    prompts.write_text(prompts.read_text() + long_prompt)
    target = load_lm(str(target_dir), device="cpu", max_seq_len=160)
    draft = load_draft_lm(str(draft_dir), target, device="cpu", max_seq_len=160)
    return {
        "root": root,
        "target_dir": target_dir,
        "draft_dir": draft_dir,
        "prompts": prompts,
        "target": target,
        "draft": draft,
    }


def traces_args(models, out, **extra) -> list[str]:
    args = {
        "target": models["target_dir"],
        "drafter": models["draft_dir"],
        "source": f"jsonl:{models['prompts']}",
        "n_samples": 7,
        "gamma": 3,
        "max_new_tokens": 20,
        "max_seq_len": 160,
        "shard_size": 4,
        "device": "cpu",
        "out": out,
        **extra,
    }
    return [f"{k}={v}" for k, v in args.items()]


def read_rows(directory) -> list[dict]:
    reader = ShardReader(directory)
    return [{k: to_tensor(v, reader.columns[k]) for k, v in reader.row(i).items()} for i in range(len(reader))]


def test_traces_cli_records_rounds_and_resumes(models, tmp_path, monkeypatch):
    from transformers import AutoModelForCausalLM

    from core.prompts import load_prompts, prompt_turns, render_prompt

    def run(out):
        return record_traces(parse_args(traces_args(models, out)), target=models["target"], draft=models["draft"])

    manifest = run(tmp_path / "reference")
    assert manifest["complete"] and manifest["skipped"] == 1 and manifest["next_source_index"] == 7
    assert manifest["layers"]["ids"] == [0, 1, 2] and manifest["layers"]["plus_final_norm"]
    assert not {"positions", "policy", "kmax"} & set(manifest["args"])  # as trace sets made before the option
    assert manifest["drafter"]["weights_hash"] != manifest["target"]["weights_hash"]
    reference = read_rows(tmp_path / "reference")
    assert len(reference) == manifest["num_rows"] > 6
    assert {int(r["sample_index"]) for r in reference} == set(range(6))
    row = reference[1]
    assert row["hidden_lastk"].shape == (4 * 32,) and row["hidden_lastk"].dtype == torch.bfloat16
    assert int(row["branch_token"]) == int(row["draft_tokens"][0]) and int(row["draft_len"]) == 3
    assert 0 <= int(row["num_accepted"]) <= 3 and row["draft_probs"].dtype == torch.float32
    assert len({int(r["num_accepted"]) for r in reference}) > 1, "want varied acceptance in this test"

    # hidden_lastk is HF hidden_states[-4:] at position - 1 (SpecBranch's H-RAD convention)
    conversation = load_prompts(f"jsonl:{models['prompts']}", n=7)[int(row["sample_index"])]
    prompt = render_prompt(models["target"].tokenizer, prompt_turns(conversation))
    prompt_rows = [r for r in reference if int(r["sample_index"]) == int(row["sample_index"])]
    emitted = []  # rebuild the generated text from the rounds: accepted drafts + the target's own token
    model = AutoModelForCausalLM.from_pretrained(models["target_dir"]).eval()
    with torch.no_grad():
        first = int(model(torch.tensor([prompt])).logits[0, -1].argmax())
    emitted = [first]
    for r in prompt_rows:
        assert int(r["position"]) == len(prompt) + len(emitted)
        seq = torch.tensor([prompt + emitted + r["draft_tokens"].tolist()])
        with torch.no_grad():
            out = model(seq, output_hidden_states=True)
        pos = int(r["position"]) - 1
        expected = torch.cat([h[0, pos] for h in out.hidden_states[-4:]]).to(torch.bfloat16)
        torch.testing.assert_close(r["hidden_lastk"].float(), expected.float(), atol=2e-2, rtol=2e-2)
        n = int(r["num_accepted"])
        emitted += r["draft_tokens"][:n].tolist() + [int(out.logits[0, pos + n].argmax())]

    # Interrupt a run after two prompts, then re-run: the same rows, none lost or repeated.
    calls = {"n": 0}
    original = SpeculativeSampling.generate

    def flaky(self, *args, **kwargs):
        calls["n"] += 1
        if calls["n"] == 3:
            raise KeyboardInterrupt
        return original(self, *args, **kwargs)

    monkeypatch.setattr(SpeculativeSampling, "generate", flaky)
    with pytest.raises(KeyboardInterrupt):
        run(tmp_path / "resumed")
    monkeypatch.setattr(SpeculativeSampling, "generate", original)
    resumed_manifest = run(tmp_path / "resumed")
    resumed = read_rows(tmp_path / "resumed")
    assert resumed_manifest["num_rows"] == len(resumed) == len(reference)
    for a, b in zip(reference, resumed):
        for key in a:
            assert torch.equal(a[key], b[key]), key


def test_traces_record_the_drafter_as_it_serves_with_draft_vocab(models, tmp_path):
    cfg = parse_args(traces_args(models, tmp_path / "limited", draft_vocab=300, n_samples=3))
    record_traces(cfg, target=models["target"], draft=models["draft"])
    drafted = torch.cat([r["draft_tokens"] for r in read_rows(tmp_path / "limited")])
    assert len(drafted) and int(drafted.max()) < 300


def test_traces_cli_errors(models, tmp_path, capsys):
    assert main(traces_args(models, tmp_path / "x")[:1] + [f"out={tmp_path / 'x'}"]) == 2
    assert "drafter=PATH is required" in capsys.readouterr().err
    assert main(traces_args(models, tmp_path / "x", gama=3)) == 2
    assert "did you mean 'gamma'" in capsys.readouterr().err
    for extra, message in (
        ({"positions": "branch"}, "positions=branch is not one of sps, specbranch"),
        ({"policy": "oracle"}, "set positions=specbranch"),
        ({"positions": "specbranch", "gamma": 1}, "needs gamma >= 2"),
        ({"positions": "specbranch", "verifier": "block"}, "verifier=block is SpS's"),
        ({"positions": "specbranch", "policy": "oracle", "temperature": 1.0}, "hrad=oracle needs temperature=0"),
    ):
        assert main(traces_args(models, tmp_path / "x", **extra)) == 2
        err = capsys.readouterr().err.strip()
        assert message in err and err.count("\n") == 0, err


def test_traces_at_serving_positions(models, tmp_path):
    """positions=specbranch: one row per surviving SpecBranch branch (where serving asks H-RAD), with H-RAD's
    inputs there and the realised label: the continuation tokens the greedy target accepts."""
    from transformers import AutoModelForCausalLM

    from core.drafters.hrad import hrad_labels
    from core.prompts import load_prompts, prompt_turns, render_prompt
    from inference.algorithms.specbranch import continuation_to_keep
    from spectrain.kinds.hrad.traces import load_trace_rows

    out = tmp_path / "serving"
    manifest = record_traces(
        parse_args(traces_args(models, out, positions="specbranch", n_samples=4, gamma=4)),
        target=models["target"],
        draft=models["draft"],
    )
    assert manifest["args"]["positions"] == "specbranch" and manifest["args"]["policy"] == "none"
    rows = read_rows(out)
    assert len(rows) == manifest["num_rows"] > 4
    assert all(int(r["draft_len"]) == 4 and int(r["num_accepted"]) >= 1 for r in rows)
    assert {int(r["num_accepted"]) for r in rows} - {1}, "want accepted continuations in this test"
    model = AutoModelForCausalLM.from_pretrained(models["target_dir"]).eval()
    conversations = load_prompts(f"jsonl:{models['prompts']}", n=4)
    checked = 0
    for index in range(2):
        prompt = render_prompt(models["target"].tokenizer, prompt_turns(conversations[index]))
        with torch.no_grad():  # the target's greedy answer: what SpecBranch emits, and past its end
            answer = model.generate(
                torch.tensor([prompt]),
                max_new_tokens=20 + 12,
                do_sample=False,
                attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
            )[0].tolist()
        for r in (r for r in rows if int(r["sample_index"]) == index):
            position, tokens = int(r["position"]), r["draft_tokens"].tolist()
            assert answer[position] == tokens[0] == int(r["branch_token"])
            realised = 0
            for j, token in enumerate(tokens[1:]):
                if position + 1 + j >= len(answer) or answer[position + 1 + j] != token:
                    break
                realised += 1
            assert int(r["num_accepted"]) == realised + 1
            assert int(r["kept"]) == continuation_to_keep(1, r["draft_max_probs"].tolist(), 0.3)  # policy=none
            with torch.no_grad():
                states = model(torch.tensor([answer[:position]]), output_hidden_states=True).hidden_states
            expected = torch.cat([h[0, -1] for h in states[-4:]]).to(torch.bfloat16)
            torch.testing.assert_close(r["hidden_lastk"].float(), expected.float(), atol=2e-2, rtol=2e-2)
            if int(r["branch_rank"]) == 0:
                assert float(r["draft_probs"][0]) == float(r["draft_max_probs"][0])
            else:
                assert r["draft_probs"][0].isnan()
            checked += 1
    assert checked > 2
    # H-RAD reads these rows as it reads SpS rounds: label = class of the realised continuation
    loaded = load_trace_rows(out, manifest, [1, 3], 4)
    accepted = torch.tensor([int(r["num_accepted"]) for r in rows])
    assert loaded.labels.tolist() == hrad_labels(accepted, [1, 3]).tolist()
    assert loaded.confidence.tolist() == [float(r["draft_max_probs"][1]) for r in rows]


@pytest.mark.real_model
def test_real_smollm2_traces_with_itself_as_drafter(smollm2, tmp_path):
    from inference.drafters import LoadedModel
    from inference.runner_loading import load_runner

    model, tokenizer = smollm2
    target = LoadedModel("smollm2", load_runner(model, max_seq_len=160), tokenizer, model)
    draft = LoadedModel("smollm2", load_runner(model, max_seq_len=160), tokenizer, model)
    manifest = record_traces(
        parse_args(
            [
                "target=smollm2",
                "drafter=smollm2",
                "source=mt_bench",
                "n_samples=1",
                "gamma=2",
                "max_new_tokens=7",
                "max_seq_len=160",
                "device=cpu",
                f"out={tmp_path / 'traces'}",
            ]
        ),
        target=target,
        draft=draft,
    )
    rows = read_rows(tmp_path / "traces")
    assert manifest["layers"]["ids"] == [26, 27, 28] and len(rows) == manifest["num_rows"] == 2  # 7 = 1 + 2 * 3
    assert all(int(r["num_accepted"]) == 2 for r in rows)  # the target drafting for itself
    assert rows[0]["hidden_lastk"].shape == (4 * 576,)
    assert all(torch.allclose(r["draft_probs"], r["draft_max_probs"]) for r in rows)  # greedy drafts = argmax
