"""The server on tiny models: starting it, its config, paced runners, requests and metrics."""

from __future__ import annotations

import re
import ssl
import threading
import time
from pathlib import Path

import httpx
import torch
from dflash_builders import make_drafter as random_dflash_drafter
from eagle3_tree_builders import random_drafter
from peagle_builders import make_peagle as random_peagle_drafter
from specblock_tree_builders import random_drafter as random_specblock_drafter
from tiny_targets import save_tiny_target

from core.prompts import render_prompt
from inference.algorithms import algorithm_class, build_algorithm
from inference.drafters import LoadedModel, load_lm
from inference.runner_loading import load_runner
from inference.sampling import SamplingParams
from inference.serve.config import parse_args
from inference.serve.scheduler import Generation
from inference.serve.server import RunningServer, build_server
from inference.serve.text import TextAssembler

MAX_SEQ, ROWS = 256, 8

# One client for the tests' plain HTTP requests: httpx.get/post build a client per call, and each loads the CA bundle
# into a new SSL context (tens of milliseconds of CPU; about 20 CPU-s over the serve tests). No keep-alive: servers
# come and go, and a later one may listen on a port an earlier one used.
http_client = httpx.Client(timeout=5.0, limits=httpx.Limits(max_keepalive_connections=0))
# The same SSL context for every OpenAI client (one per test server), for the same reason.
CLIENT_TLS = ssl.create_default_context()


PROMPT = "Name a prime."


def tiny_models(root: Path) -> dict:
    """The target (its weights and tokenizer: each server gets a runner of its own, ``own_target``), a draft LM
    directory, and the random feature drafters (EAGLE-3, SpecBlock, DFlash, P-EAGLE); ``ar`` is the reference, on a
    runner of its own. The other ``test_serve_*`` modules build theirs with it too."""
    target_dir = save_tiny_target(root / "target", layers=4, logit_scale=8.0)
    draft_dir = save_tiny_target(root / "draft", layers=4, logit_scale=8.0, noise=0.02)
    target = load_lm(str(target_dir), max_seq_len=MAX_SEQ)
    ar = build_algorithm("ar", load_runner(target.model, max_seq_len=MAX_SEQ))
    return {
        "dir": target_dir,
        "draft": draft_dir,
        "target": target,
        "ar": ar,
        "eagle3": random_drafter(target.model, draft_vocab=2048),
        "specblock": random_specblock_drafter(target.model, draft_vocab=2048),
        "dflash": random_dflash_drafter(target.model, draft_vocab=2048, mask_token_id=3).eval(),
        "peagle": random_peagle_drafter(target.model, draft_vocab=2048),
    }


def own_target(tiny) -> LoadedModel:
    """The tiny target's weights with a runner (KV cache) of their own: every server gets one."""
    target = tiny["target"]
    runner = load_runner(target.model, max_seq_len=MAX_SEQ, max_batch_size=2 * ROWS)
    return LoadedModel(target.name, runner, target.tokenizer, target.model)


def serve_config(tiny, *keys: str):
    """The tiny server's config: ``ROWS`` rows side by side for an algorithm that batches, one otherwise."""
    name = next((k.split("=", 1)[1].split("@")[0] for k in keys if k.startswith("algorithm=")), "ar")
    rows = ROWS if algorithm_class(name).batchable else 1
    return parse_args(
        [
            f"target={tiny['dir']}",
            f"drafter={tiny['draft']}",
            "model_name=tiny",
            f"max_seq_len={MAX_SEQ}",
            f"batch_size={rows}",
            *keys,
        ]
    )


def start(tiny, *keys: str) -> RunningServer:
    drafters = {
        "eagle3": tiny["eagle3"],
        "specblock": tiny["specblock"],
        "dflash": tiny["dflash"],
        "peagle": tiny["peagle"],
    }
    return RunningServer(build_server(serve_config(tiny, *keys), target=own_target(tiny), drafters=drafters))


def runner_of(server: RunningServer):
    """The target runner the server's engine steps."""
    return server.server.model.algorithm.target


def reference(tiny, prompt_ids: list[int], n: int, temperature: float = 0.0, seed: int = 0) -> list[int]:
    """AR's answer in this process, with the server's sampling stream for ``seed``."""
    eos = tiny["target"].tokenizer.eos_token_id
    return (
        tiny["ar"]
        .generate(
            prompt_ids,
            max_new_tokens=n,
            sampling=SamplingParams(temperature),
            generator=torch.Generator().manual_seed(seed),
            eos_ids=[eos],
        )
        .tokens
    )


def chat_ids(tiny, content: str) -> list[int]:
    return render_prompt(tiny["target"].tokenizer, [{"role": "user", "content": content}])


def metric(server: RunningServer, name: str, **labels: str) -> float:
    """The sum of ``name``'s samples whose labels include ``labels``."""
    text = http_client.get(f"{server.url}/metrics").text
    total = 0.0
    for found, value in re.findall(rf"^{re.escape(name)}(?:{{(.*)}})? ([0-9.e+-]+)$", text, re.M):
        have = dict(re.findall(r'(\w+)="([^"]*)"', found))
        total += float(value) if all(have.get(k) == v for k, v in labels.items()) else 0.0
    return total


ALGORITHMS = {
    "ar": [],
    "ar@one_at_a_time": ["batch_size=1"],
    "sps": ["algorithm=sps", "gamma=3"],
    "pearl": ["algorithm=pearl", "gamma=3"],
    "specbranch": ["algorithm=specbranch", "gamma=3"],
    "eagle3_tree": ["algorithm=eagle3_tree", "tree_depth=3", "tree_topk=2", "tree_total=8"],
    "specblock_tree": ["algorithm=specblock_tree", "specblock_budget=16", "specblock_width=4"],
    "self_draft": ["algorithm=self_draft", "self_draft_L=3", "self_draft_N=2"],
    "dflash": ["algorithm=dflash"],
    "peagle": ["algorithm=peagle"],
    "ssd": ["algorithm=ssd@gamma=3@ssd_budget=3@ssd_fallback=fast@ssd_fast=random"],
}


def error_of(response: httpx.Response) -> dict:
    body = response.json()
    assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}
    assert "\n" not in body["error"]["message"]
    return body["error"]


def wait_for(condition, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.01)


class Paced:
    """The served target's forwards, counted and slowed to ``delay`` seconds each (5 ms), so that a request of 200
    tokens still runs when the test acts (a tiny model otherwise finishes before an HTTP round trip); ``gate``
    holds the first one."""

    def __init__(self, runner, gate: threading.Event | None = None, delay: float = 0.005):
        self.runner, self.gate, self.delay, self.calls, self.forward = runner, gate, delay, 0, runner.forward

    def __call__(self, *args, **kwargs):
        if self.gate is not None:
            self.gate.wait(60)
        self.calls += 1
        time.sleep(self.delay)
        return self.forward(*args, **kwargs)

    def __enter__(self):
        self.runner.forward = self
        return self

    def __exit__(self, *exc):
        del self.runner.forward  # the class's method again


def submit(server: RunningServer, prompt_ids: list[int], n: int, temperature: float = 0.0, seed: int = 0) -> tuple:
    """A request handed to the scheduler directly, past the schema: (its Generation, the list its events arrive
    in)."""
    model, events = server.server.model, []
    gen = Generation(
        prompt_ids,
        n,
        SamplingParams(temperature),
        seed,
        TextAssembler(model.tokenizer),
        events.append,
        model.eos_ids,
        stream=False,
    )
    server.server.scheduler.submit(gen)
    return gen, events
