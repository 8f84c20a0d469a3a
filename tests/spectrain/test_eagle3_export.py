"""EAGLE-3 export contracts: each engine's loader, re-implemented from its source, must place every tensor we write.

A round trip alone proves nothing (SGLang silently skips unknown keys; a layout can round-trip and still load
wrong), so the loaders below follow the engines' code. SGLang needs CUDA, so its loader stays re-implemented here,
mirroring SGLang 0.5.23 (the PyPI wheel), ``sglang/srt/models/llama_eagle3.py``:
``LlamaForCausalLMEagle3.load_weights`` (legacy ``midlayer`` -> ``layers.0``, stacked qkv / gate_up, d2t ->
``hot_token_id = d2t + arange``, t2d skipped, unknown keys dropped without a word) and
``sglang/srt/models/llama.py:set_eagle3_layers_to_capture`` (``eagle_config`` ids + 1). vLLM's side
(``Eagle3LlamaForCausalLM.load_weights`` + the speculators config conversion: d2t -> ``draft_id_to_target_id``,
top-level INPUT-of-layer ids, ``norm_before_residual`` default True) is re-implemented too; the speculators layout is
also checked against the speculators library itself in ``tests/spectrain/test_speculators_interop.py``.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from eagle3_export_builders import AUX, DRAFT_VOCAB, VOCAB, lightning_ckpt, make_drafter, tiny_target
from safetensors.torch import load_file, save_file
from transformers import LlamaConfig
from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding, apply_rotary_pos_emb

from core.assets import target_record
from core.drafters.eagle3 import Eagle3Drafter
from core.drafters.eagle3.layouts import Eagle3Checkpoint, layout_config, layout_tensors, read_checkpoint
from core.drafters.eagle3.kind import load_eagle3
from inference.drafters import LoadedModel
from inference.runner import ModelRunner
from spectrain import export as export_cli


@pytest.fixture(scope="module")
def target_dir(tmp_path_factory) -> Path:
    directory = tmp_path_factory.mktemp("target")
    tiny_target(0).save_pretrained(directory)
    return directory


def run_export(*args: str) -> None:
    assert export_cli.main(list(args)) == 0


def exported(tmp_path: Path, target_dir: Path, drafter: Eagle3Drafter, layout: str) -> Path:
    ckpt = lightning_ckpt(tmp_path / "last.ckpt", drafter, target_record(str(target_dir)))
    out = tmp_path / layout
    run_export(f"ckpt={ckpt}", f"format={layout}", f"out={out}")
    return out


# ------------------------------------------------------------------------------------------------------------
# The engines' loaders, re-implemented from their source


STACKED = [
    (".qkv_proj", ".q_proj", "q"),
    (".qkv_proj", ".k_proj", "k"),
    (".qkv_proj", ".v_proj", "v"),
    (".gate_up_proj", ".gate_proj", 0),
    (".gate_up_proj", ".up_proj", 1),
]


def engine_params(layer_cfg: dict, top: dict, layer_prefix: str, extra: tuple[str, ...] = ()) -> dict:
    """Parameter name -> NaN tensor of the engine model's shape (fused qkv / gate_up as both engines build them)."""
    hidden, inter = layer_cfg["hidden_size"], layer_cfg["intermediate_size"]
    heads, kv = layer_cfg["num_attention_heads"], layer_cfg["num_key_value_heads"]
    head_dim = layer_cfg.get("head_dim") or hidden // heads
    target_hidden = top.get("target_hidden_size") or hidden
    shapes = {
        "model.embed_tokens.weight": (layer_cfg["vocab_size"], hidden),
        "model.fc.weight": (hidden, 3 * target_hidden),
        f"{layer_prefix}self_attn.qkv_proj.weight": ((heads + 2 * kv) * head_dim, 2 * hidden),
        f"{layer_prefix}self_attn.o_proj.weight": (hidden, heads * head_dim),
        f"{layer_prefix}mlp.gate_up_proj.weight": (2 * inter, hidden),
        f"{layer_prefix}mlp.down_proj.weight": (hidden, inter),
        f"{layer_prefix}input_layernorm.weight": (hidden,),
        f"{layer_prefix}hidden_norm.weight": (hidden,),
        f"{layer_prefix}post_attention_layernorm.weight": (hidden,),
        "model.norm.weight": (hidden,),
        "lm_head.weight": (top["draft_vocab_size"], hidden),
    }
    params = {name: torch.full(shape, float("nan")) for name, shape in shapes.items()}
    for name in extra:
        params[name] = torch.zeros(top["draft_vocab_size"], dtype=torch.long)
    return params


def load_shard(params: dict, name: str, weight: torch.Tensor, shard, layer_cfg: dict) -> None:
    param = params[name]
    heads, kv = layer_cfg["num_attention_heads"], layer_cfg["num_key_value_heads"]
    head_dim = layer_cfg.get("head_dim") or layer_cfg["hidden_size"] // heads
    rows = {
        "q": (0, heads * head_dim),
        "k": (heads * head_dim, (heads + kv) * head_dim),
        "v": ((heads + kv) * head_dim, (heads + 2 * kv) * head_dim),
        0: (0, layer_cfg["intermediate_size"]),
        1: (layer_cfg["intermediate_size"], 2 * layer_cfg["intermediate_size"]),
    }
    start, end = rows[shard]
    assert param[start:end].shape == weight.shape, (name, shard, weight.shape)
    param[start:end] = weight


def sglang_load(directory: Path) -> SimpleNamespace:
    """SGLang 0.5.23: registry by architecture, LlamaForCausalLMEagle3.load_weights, eagle_config aux ids (+1)."""
    raw = json.loads((directory / "config.json").read_text())
    assert raw["architectures"] == ["LlamaForCausalLMEagle3"] and raw["num_hidden_layers"] == 1
    params = engine_params(raw, raw, "model.layers.0.")
    hot_token_id, skipped, loaded = None, [], set()
    for name, weight in load_file(str(directory / "model.safetensors")).items():
        name = name.replace("midlayer", "layers.0")  # its legacy_name_map
        if "d2t" in name:
            hot_token_id = weight + torch.arange(weight.shape[0])
            continue
        if "t2d" in name:
            continue
        for param_name, weight_name, shard in STACKED:
            if weight_name not in name:
                continue
            name = name.replace(weight_name, param_name)
            target = f"model.{name}" if name not in params else name
            if target in params:
                load_shard(params, target, weight, shard, raw)
                loaded.add(target)
            else:
                skipped.append(name)
            break
        else:
            target = name if name in params else f"model.{name}"
            if target in params:
                assert params[target].shape == weight.shape, target
                params[target] = weight.clone()
                loaded.add(target)
            else:
                skipped.append(name)  # SGLang drops these without a word
    eagle = raw.get("eagle_config") or {}
    return SimpleNamespace(
        params=params,
        skipped=skipped,
        loaded=loaded,
        hot_token_id=hot_token_id,
        capture_inputs=[i + 1 for i in eagle["eagle_aux_hidden_state_layer_ids"]],
        use_aux=eagle.get("use_aux_hidden_state", True),
        norm_before_residual=False,
        layer_cfg=raw,
        prefix="model.layers.0.",
    )


def vllm_config(raw: dict) -> dict:
    """vLLM's hf_config for a drafter dir: speculators conversion (base.py + algos.update_eagle3) or as-is."""
    if "speculators_model_type" in raw:
        assert raw["speculators_model_type"] == "eagle3"
        spec = raw["speculators_config"]
        assert spec["proposal_methods"][0]["speculative_tokens"] >= 1 and spec["verifier"]["name_or_path"]
        config = dict(raw["transformer_layer_config"])
        config["draft_vocab_size"] = raw.get("draft_vocab_size")
        if raw.get("target_hidden_size") is not None:
            config["target_hidden_size"] = raw["target_hidden_size"]
        config["norm_before_residual"] = raw.get("norm_before_residual", True)
        config["architectures"] = ["Eagle3LlamaForCausalLM"]
        if raw.get("eagle_aux_hidden_state_layer_ids"):
            config["eagle_aux_hidden_state_layer_ids"] = raw["eagle_aux_hidden_state_layer_ids"]
        config["num_lookahead_tokens"] = spec["proposal_methods"][0]["speculative_tokens"]
        return config
    assert raw["architectures"][0] in ("LlamaForCausalLMEagle3", "Eagle3LlamaForCausalLM")  # -> llama_eagle3
    return {**raw, "norm_before_residual": raw.get("norm_before_residual", False)}


def vllm_load(directory: Path) -> SimpleNamespace:
    """vLLM: Eagle3LlamaForCausalLM.load_weights, then LlamaModel.load_weights for model.* (strict lookups)."""
    config = vllm_config(json.loads((directory / "config.json").read_text()))
    assert config.get("num_hidden_layers", 1) == 1
    params = engine_params(config, config, "model.layers.0.", extra=("draft_id_to_target_id",))
    unknown, loaded = [], set()
    for name, weight in load_file(str(directory / "model.safetensors")).items():
        if "t2d" in name:
            continue
        if "d2t" in name:
            name = name.replace("d2t", "draft_id_to_target_id")
        elif "lm_head" not in name:
            name = "model." + name
        name = name.replace("midlayer.", "layers.0.")
        for param_name, weight_name, shard in STACKED:
            if weight_name in name:
                name = name.replace(weight_name, param_name)
                if name not in params:
                    unknown.append(name)  # vLLM: KeyError
                else:
                    load_shard(params, name, weight, shard, config)
                    loaded.add(name)
                break
        else:
            if name not in params:
                unknown.append(name)
                continue
            assert params[name].shape == weight.shape, name
            params[name] = weight.clone()
            loaded.add(name)
    return SimpleNamespace(
        params=params,
        skipped=unknown,
        loaded=loaded,
        config=config,
        targets=torch.arange(config["draft_vocab_size"]) + params["draft_id_to_target_id"],
        capture_inputs=config["eagle_aux_hidden_state_layer_ids"],
        norm_before_residual=config["norm_before_residual"],
        layer_cfg=config,
        prefix="model.layers.0.",
    )


def assert_placed(engine: SimpleNamespace, drafter: Eagle3Drafter) -> None:
    """No key skipped; every engine parameter but the (target-shared) embedding written with OUR tensor."""
    ours = drafter.state_dict()
    assert engine.skipped == []
    for name, value in engine.params.items():
        if name in ("model.embed_tokens.weight", "draft_id_to_target_id"):
            continue
        assert name in engine.loaded and not torch.isnan(value).any(), f"{name} never written"
    p, q = engine.params, engine.prefix
    attn = "midlayer.self_attn."
    assert torch.equal(p[f"{q}self_attn.qkv_proj.weight"], torch.cat([ours[f"{attn}{x}_proj.weight"] for x in "qkv"]))
    assert torch.equal(
        p[f"{q}mlp.gate_up_proj.weight"],
        torch.cat([ours["midlayer.mlp.gate_proj.weight"], ours["midlayer.mlp.up_proj.weight"]]),
    )
    for ours_name, engine_name in [
        ("midlayer.self_attn.o_proj.weight", f"{q}self_attn.o_proj.weight"),
        ("midlayer.mlp.down_proj.weight", f"{q}mlp.down_proj.weight"),
        ("midlayer.input_layernorm.weight", f"{q}input_layernorm.weight"),
        ("midlayer.hidden_norm.weight", f"{q}hidden_norm.weight"),
        ("midlayer.post_attention_layernorm.weight", f"{q}post_attention_layernorm.weight"),
        ("fc.weight", "model.fc.weight"),
        ("norm.weight", "model.norm.weight"),
        ("lm_head.weight", "lm_head.weight"),
    ]:
        assert torch.equal(p[engine_name], ours[ours_name]), engine_name


def engine_forward(engine: SimpleNamespace, embed: torch.Tensor, tokens: torch.Tensor, aux: torch.Tensor):
    """Both engines' llama_eagle3 LlamaModel.forward on a causal prefill, from the LOADED (fused) weights, with
    transformers' RoPE; returns logits over the draft vocabulary."""
    cfg, p, q = engine.layer_cfg, engine.params, engine.prefix
    heads, kv, hidden = cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["hidden_size"]
    head_dim = cfg.get("head_dim") or hidden // heads

    def rms(x, weight):
        return weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + cfg["rms_norm_eps"]))

    embeds = rms(embed[tokens], p[f"{q}input_layernorm.weight"])
    g = aux @ p["model.fc.weight"].T
    normed = rms(g, p[f"{q}hidden_norm.weight"])
    residual = normed if engine.norm_before_residual else g
    qkv = torch.cat([embeds, normed], -1) @ p[f"{q}self_attn.qkv_proj.weight"].T
    length = tokens.shape[1]
    qs, ks, vs = qkv.split([heads * head_dim, kv * head_dim, kv * head_dim], -1)
    qs, ks, vs = (t.view(1, length, -1, head_dim).transpose(1, 2) for t in (qs, ks, vs))
    rope_cfg = LlamaConfig(
        hidden_size=hidden,
        num_attention_heads=heads,
        head_dim=head_dim,
        rope_theta=cfg["rope_theta"],
        rope_scaling=cfg.get("rope_scaling"),
        max_position_embeddings=cfg["max_position_embeddings"],
    )
    cos, sin = LlamaRotaryEmbedding(rope_cfg)(vs, torch.arange(length)[None])
    qs, ks = apply_rotary_pos_emb(qs, ks, cos, sin)
    ks, vs = ks.repeat_interleave(heads // kv, 1), vs.repeat_interleave(heads // kv, 1)
    scores = (qs @ ks.transpose(-1, -2)) / math.sqrt(head_dim)
    scores = scores.masked_fill(~torch.ones(length, length, dtype=torch.bool).tril(), float("-inf"))
    attn = (scores.softmax(-1) @ vs).transpose(1, 2).reshape(1, length, -1) @ p[f"{q}self_attn.o_proj.weight"].T
    residual = attn + residual  # fused add + post_attention_layernorm
    gate, up = (rms(residual, p[f"{q}post_attention_layernorm.weight"]) @ p[f"{q}mlp.gate_up_proj.weight"].T).chunk(
        2, -1
    )
    out = (torch.nn.functional.silu(gate) * up) @ p[f"{q}mlp.down_proj.weight"].T + residual
    return rms(out, p["model.norm.weight"]) @ p["lm_head.weight"].T


# ------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("shape", ["same_hidden", "wider_drafter"])
def test_sglang_loader_places_every_tensor(tmp_path, target_dir, shape):
    target = LlamaConfig.from_pretrained(target_dir)
    drafter = make_drafter(target, hidden=None if shape == "same_hidden" else 48)
    directory = exported(tmp_path, target_dir, drafter, "sglang")
    engine = sglang_load(directory)
    assert_placed(engine, drafter)
    raw = json.loads((directory / "config.json").read_text())
    assert raw["vocab_size"] == VOCAB and raw["draft_vocab_size"] == DRAFT_VOCAB  # target vocab; lm_head rows
    assert raw["target_hidden_size"] == 32 and raw["hidden_size"] == drafter.config.hidden_size
    assert raw["tie_word_embeddings"] is False and engine.use_aux is True
    assert torch.equal(engine.hot_token_id, torch.nonzero(drafter.t2d).flatten())  # d2t offsets -> target ids
    assert raw["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == AUX  # output-of-layer ids
    assert engine.capture_inputs == [i + 1 for i in AUX]
    # the same directory in vLLM: top-level ids are input-of-layer ids, d2t maps the same way
    vllm = vllm_load(directory)
    assert_placed(vllm, drafter)
    assert vllm.capture_inputs == engine.capture_inputs and vllm.norm_before_residual is False
    assert torch.equal(vllm.targets, engine.hot_token_id)
    own = "embed_tokens.weight" in load_file(str(directory / "model.safetensors"))
    assert own == (shape == "wider_drafter")  # a drafter with its own embedding must ship it


@pytest.mark.parametrize("norm_before_residual", [False, True])
def test_vllm_loader_places_every_speculators_tensor(tmp_path, target_dir, norm_before_residual):
    target = LlamaConfig.from_pretrained(target_dir)
    drafter = make_drafter(target, norm_before_residual=norm_before_residual)
    directory = exported(tmp_path, target_dir, drafter, "speculators")
    engine = vllm_load(directory)
    assert_placed(engine, drafter)
    config = engine.config
    assert config["architectures"] == ["Eagle3LlamaForCausalLM"] and config["draft_vocab_size"] == DRAFT_VOCAB
    assert config["vocab_size"] == VOCAB and config["target_hidden_size"] == 32
    assert config["norm_before_residual"] is norm_before_residual  # explicit: vLLM would default to True
    assert [i - 1 for i in config["eagle_aux_hidden_state_layer_ids"]] == AUX
    assert config["num_lookahead_tokens"] == 3
    assert torch.equal(engine.targets, torch.nonzero(drafter.t2d).flatten())
    raw = json.loads((directory / "config.json").read_text())
    assert raw["speculators_config"]["verifier"]["name_or_path"] == str(target_dir)
    assert {"layers.0.self_attn.q_proj.weight", "t2d", "d2t"} <= set(load_file(str(directory / "model.safetensors")))


@pytest.mark.parametrize(
    "layout, norm_before_residual", [("sglang", False), ("speculators", True), ("speculators", False)]
)
def test_engines_compute_what_our_module_computes(tmp_path, target_dir, layout, norm_before_residual):
    """Loaded by the engine's rules and run by its forward, the export gives our logits: catches a swapped
    concat order or norm, and a norm_before_residual the engine would not apply."""
    model = tiny_target(0)
    drafter = make_drafter(model.config, norm_before_residual=norm_before_residual)
    drafter.use_target_embedding(model.model.embed_tokens.weight.detach())
    directory = exported(tmp_path, target_dir, drafter, layout)
    engine = sglang_load(directory) if layout == "sglang" else vllm_load(directory)
    tokens, aux = torch.randint(0, VOCAB, (1, 6)), torch.randn(1, 6, 96)
    with torch.no_grad():
        ours = drafter(tokens, aux).logits[0]
        theirs = engine_forward(engine, model.model.embed_tokens.weight, torch.roll(tokens, -1, 1), aux)
    # our forward reads token t+1 at row t (the EAGLE shift); the engine is handed the shifted tokens
    torch.testing.assert_close(ours[:, :-1], theirs[:, :-1], rtol=1e-4, atol=1e-4)


def test_layer_id_conventions_name_the_same_tensors():
    """Our output-of-layer id i, SGLang's capture of layer i + 1's input and vLLM's input id i + 1 are one tensor."""
    model = tiny_target(0)
    ids = torch.randint(0, VOCAB, (1, 5))
    with torch.no_grad():
        hf = model(ids, output_hidden_states=True).hidden_states  # [0] = embeddings = input of layer 0
        ours = ModelRunner.from_hf_model(model, max_seq_len=16).forward(ids, capture_layers=AUX).hidden
    for layer in AUX:
        torch.testing.assert_close(ours[layer], hf[layer + 1])  # vLLM/SGLang capture the input of layer + 1


def test_round_trip_native_sglang_speculators_native(tmp_path, target_dir):
    drafter = make_drafter(LlamaConfig.from_pretrained(target_dir))
    native = exported(tmp_path, target_dir, drafter, "native")
    run_export(f"ckpt={native}", "format=sglang", f"out={tmp_path / 's'}")
    run_export(f"ckpt={tmp_path / 's'}", "format=speculators", f"out={tmp_path / 'v'}")
    run_export(f"import={tmp_path / 'v'}", "format=native", f"out={tmp_path / 'back'}")
    first, back = read_checkpoint(native), read_checkpoint(tmp_path / "back")
    assert first.config == back.config == drafter.config and first.target == back.target
    assert first.tensors.keys() == back.tensors.keys() == set(Eagle3Checkpoint.from_drafter(drafter, None).tensors)
    for name, tensor in first.tensors.items():
        assert torch.equal(tensor, back.tensors[name]), name
    config = json.loads((native / "config.json").read_text())["spectrain"]
    assert (
        config["kind"] == "eagle3"
        and config["layers"]["ids"] == AUX
        and "output of decoder layer" in config["layers"]["convention"]
    )
    assert config["target"]["config_hash"] and config["vocab"] == {"vocab_size": VOCAB, "draft_vocab_size": DRAFT_VOCAB}
    assert json.loads((native / "metrics.json").read_text())["val/tau_sim"] == 2.5
    assert "lr: 5.0e-05" in (native / "recipe.yaml").read_text()
    assert (tmp_path / "back" / "recipe.yaml").is_file()  # provenance survives re-export


def foreign_dir(
    directory: Path,
    drafter: Eagle3Drafter,
    layout: str,
    *,
    drop: tuple[str, ...] = (),
    add: dict | None = None,
    config_edit: dict | None = None,
    bin_file: bool = False,
) -> Path:
    """A checkpoint as another trainer writes it: engine config only (no spectrain block)."""
    ckpt = Eagle3Checkpoint.from_drafter(drafter, {"name": "meta-llama/x", "architectures": ["LlamaForCausalLM"]})
    directory.mkdir()
    config = layout_config(ckpt, layout, dtype=torch.float32)
    config.pop("spectrain")
    config.update(config_edit or {})
    tensors = {k: v for k, v in layout_tensors(ckpt.tensors, layout).items() if k not in drop} | (add or {})
    if bin_file:
        torch.save(tensors, directory / "pytorch_model.bin")
    else:
        save_file(tensors, str(directory / "model.safetensors"))
    (directory / "config.json").write_text(json.dumps(config))
    return directory


def test_import_reads_foreign_sglang_and_speculators_checkpoints(tmp_path, target_dir):
    drafter = make_drafter(LlamaConfig.from_pretrained(target_dir))
    # a hub drafter: pytorch_model.bin, no t2d, ids only in eagle_config
    hub = foreign_dir(
        tmp_path / "hub",
        drafter,
        "sglang",
        drop=("t2d",),
        bin_file=True,
        config_edit={"eagle_aux_hidden_state_layer_ids": None},
    )
    run_export(f"import={hub}", f"target={target_dir}", f"out={tmp_path / 'a'}")
    imported = read_checkpoint(tmp_path / "a")
    ours = Eagle3Checkpoint.from_drafter(drafter, None).tensors
    assert imported.config == drafter.config and imported.target["config_hash"]
    assert all(torch.equal(imported.tensors[k], v) for k, v in ours.items())
    # speculators with its own embedding: kept, and written again on export
    embed = torch.randn(VOCAB, 32)
    spec = foreign_dir(tmp_path / "spec", drafter, "speculators", add={"embed_tokens.weight": embed})
    run_export(f"import={spec}", f"target={target_dir}", "format=sglang", f"out={tmp_path / 'b'}")
    again = read_checkpoint(tmp_path / "b")
    assert again.config.own_embedding and torch.equal(again.tensors["embed_tokens.weight"], embed)
    assert torch.equal(again.build().embed_tokens.weight, embed)


@pytest.mark.parametrize(
    "case, needle",
    [
        ("unknown_key", "unknown tensors ['midlayer.self_attn.rotary_emb.inv_freq']"),
        ("trainer_prefix", "unknown tensors ['module.fc.weight']"),
        ("missing_key", "lacks ['midlayer.hidden_norm.weight']"),
        ("sglang_norm_before_residual", "norm_before_residual=true, which SGLang ignores"),
        ("inconsistent_ids", "name different layers"),
        ("fc_norm_without_weights", "config.json sets fc_norm=true but the weights lack fc_norm.0.weight"),
        ("fc_norm_weights_without_flag", "config.json leaves fc_norm off but the weights hold fc_norm.0.weight"),
        ("norm_before_fc", "sets norm_before_fc=true (one norm over the concatenated aux layers)"),
        ("sglang_eagle31_flag", "sglang-layout config sets norm_output=true"),
        ("bad_vocab_map", "d2t + arange != nonzero(t2d)"),
        ("no_target", "does not record its target: give target=NAME_OR_DIR"),
        ("no_ids_no_target", "does not name its aux layers; give target=NAME_OR_DIR"),
        ("wrong_target_vocab", "differs from target"),
    ],
)
def test_import_refuses_what_an_engine_would_load_wrong(tmp_path, target_dir, case, needle, capsys):
    drafter = make_drafter(LlamaConfig.from_pretrained(target_dir))
    fc = Eagle3Checkpoint.from_drafter(drafter, None).tensors["fc.weight"]
    layout, kw = "sglang", {}
    if case == "unknown_key":
        kw = {"add": {"midlayer.self_attn.rotary_emb.inv_freq": torch.ones(4)}}
    elif case == "trainer_prefix":
        kw = {"drop": ("fc.weight",), "add": {"module.fc.weight": fc}}
    elif case == "missing_key":
        kw = {"drop": ("midlayer.hidden_norm.weight",)}
    elif case == "sglang_norm_before_residual":
        kw = {"config_edit": {"norm_before_residual": True}}
    elif case == "inconsistent_ids":
        kw = {"config_edit": {"eagle_aux_hidden_state_layer_ids": AUX}}  # output ids written where input ids belong
    elif case == "fc_norm_without_weights":
        layout, kw = "speculators", {"config_edit": {"fc_norm": True}}
    elif case == "fc_norm_weights_without_flag":
        layout, kw = "speculators", {"add": {f"fc_norm.{i}.weight": torch.ones(32) for i in range(3)}}
    elif case == "norm_before_fc":
        layout, kw = "speculators", {"config_edit": {"norm_before_fc": True}}
    elif case == "sglang_eagle31_flag":
        kw = {"config_edit": {"norm_output": True}}
    elif case == "bad_vocab_map":
        kw = {"add": {"d2t": torch.zeros(DRAFT_VOCAB, dtype=torch.long)}}
    elif case == "wrong_target_vocab":
        kw = {"config_edit": {"vocab_size": VOCAB + 1}, "add": {"t2d": torch.cat([drafter.t2d, drafter.t2d[:1]])}}
    elif case == "no_ids_no_target":
        kw = {"config_edit": {"eagle_config": {"use_aux_hidden_state": True}, "eagle_aux_hidden_state_layer_ids": None}}
    source = foreign_dir(tmp_path / "src", drafter, layout, **kw)
    target = [] if case.startswith("no_") else [f"target={target_dir}"]
    assert export_cli.main([f"import={source}", *target, f"out={tmp_path / 'out'}"]) == 2
    err = capsys.readouterr().err.strip()
    assert needle in err and "\n" not in err, err
    assert not (tmp_path / "out").exists()


def test_export_refuses_bad_requests(tmp_path, target_dir, capsys):
    target = target_record(str(target_dir))
    residual_true = lightning_ckpt(
        tmp_path / "a.ckpt", make_drafter(LlamaConfig.from_pretrained(target_dir), norm_before_residual=True), target
    )
    bare = tmp_path / "bare.ckpt"
    torch.save({"state_dict": {"drafter.fc.weight": torch.zeros(1)}}, bare)
    (tmp_path / "taken").mkdir()
    (tmp_path / "taken" / "x").write_text("")
    tiny_target(5).save_pretrained(tmp_path / "other")  # same shapes, other weights
    capsys.readouterr()  # drop save_pretrained's progress bar
    cases = [
        (
            [f"ckpt={residual_true}", "format=sglang", f"out={tmp_path / 'o1'}"],
            "retrain with norm_before_residual=false",
        ),
        ([f"ckpt={bare}", f"out={tmp_path / 'o2'}"], "has no 'spectrain' metadata"),
        ([f"ckpt={residual_true}", f"out={tmp_path / 'taken'}"], "already exists"),
        (
            [f"ckpt={residual_true}", f"import={bare}", f"out={tmp_path / 'o3'}"],
            "exactly one of ckpt=PATH or import=PATH",
        ),
        ([f"ckpt={residual_true}", "format=onnx", f"out={tmp_path / 'o4'}"], "format must be one of native, sglang"),
        ([f"ckpt={residual_true}", f"target={tmp_path / 'other'}", f"out={tmp_path / 'o5'}"], "was trained for target"),
    ]
    for args, needle in cases:
        assert export_cli.main(args) == 2
        err = capsys.readouterr().err.strip()
        assert needle in err and "\n" not in err, (args, err)


def test_load_eagle3_runs_only_on_its_target(tmp_path, target_dir):
    model = tiny_target(0)
    drafter = make_drafter(model.config)
    native = exported(tmp_path, target_dir, drafter, "native")
    target = LoadedModel(str(target_dir), ModelRunner.from_hf_model(model, max_seq_len=32), None, model)
    loaded = load_eagle3(str(native), target)
    assert loaded.embed_tokens.weight.data_ptr() == target.runner.embed_tokens.weight.data_ptr()  # shared
    drafter.use_target_embedding(model.model.embed_tokens.weight.detach())
    tokens, aux = torch.randint(0, VOCAB, (1, 5)), torch.randn(1, 5, 96)
    with torch.no_grad():
        torch.testing.assert_close(loaded(tokens, aux, steps=2).logits[1], drafter(tokens, aux, steps=2).logits[1])
    other_dir = tmp_path / "other"
    tiny_target(5).save_pretrained(other_dir)  # same config, other weights
    other = LoadedModel(str(other_dir), ModelRunner.from_hf_model(tiny_target(5), max_seq_len=32), None, None)
    with pytest.raises(ValueError, match=r"was trained for target '.*target.*' \(config \w+, weights \w+\), not"):
        load_eagle3(str(native), other)
    with pytest.raises(ValueError, match="does not record its target; import it first"):
        load_eagle3(str(foreign_dir(tmp_path / "f", drafter, "sglang")), target)
