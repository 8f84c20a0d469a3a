"""``python -m benchmarks.serve_load target=smollm2 algorithm=ar clients=[1,4] requests=8 max_tokens=64 threads=1``

Load test of ``inference.serve`` against the engine called directly in one process, on the same loaded model and
the same held-out GSM-symbolic prompts (chat-rendered, greedy): each request through ``algorithm.generate`` and
then through the HTTP server on 127.0.0.1 by one client, in turn (so both meet the same machine load), then the
server with each larger number of concurrent clients (real HTTP, OpenAI's JSON, non-streaming). Prints tokens/s, latency
percentiles, the server's overhead against the direct engine, and how many answers equal the direct ones token
for token. Bounded: ``requests`` per run, and no new request starts after ``time_limit`` seconds. Any key of
``inference.serve`` (``algorithm``, ``drafter``, ``batch_size``, ...) applies.

With ``poisoned=true`` (the default) the largest client count runs once more beside one more client that sends
nothing but requests the server cannot serve (a seed past 2^63, a temperature of 1e-45, an overlong or a fifth
stop string, a body over the size limit), in turn, until the others finish: each must be refused with a 4xx, and
every other answer must still succeed and equal the direct engine's. ``out=DIR`` also writes ``DIR/results.json``
(the config, the machine's threads, and every run's figures and answers).
"""

from __future__ import annotations

import json
import statistics
import sys
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import torch
from omegaconf import OmegaConf

from benchmarks.config import Bench, Output, parse_bench
from core.overrides import OverrideError, run_cli
from core.prompts import load_prompts, prompt_turns, render_prompt
from inference.algorithms.options import apply_threads
from inference.device import cpu_description
from inference.sampling import SamplingParams
from inference.serve.config import ServeConfig
from inference.serve.config import parse_args as parse_serve_args
from inference.serve.server import RunningServer, build_server

USAGE = "python -m benchmarks.serve_load target=smollm2 algorithm=ar clients=[1,4] requests=8 max_tokens=64"


@dataclass
class LoadConfig(ServeConfig, Output, Bench):
    """The server's arguments and the load's; ``out``: a directory for results.json (optional); ``bench``: where
    the prompts come from (their first user turn)."""

    clients: list[int] = field(default_factory=lambda: [1, 4])  # concurrent clients, one run each
    requests: int = 8  # requests per run
    max_tokens: int = 64  # per request (greedy, so every run generates the same tokens)
    time_limit: float = 600.0  # seconds per run after which no new request starts
    poisoned: bool = True  # one more run of the most clients, beside a client sending requests that must be refused


@dataclass
class Run:
    label: str
    latencies: list[float]
    tokens: int
    wall_s: float
    answers: dict[int, list[int]]

    def record(self, direct: Run | None) -> dict:
        """The run's figures as ``results.json`` keeps them."""
        equal, compared = self.equal_to(direct)
        return {
            "label": self.label,
            "requests": len(self.answers),
            "tokens": self.tokens,
            "wall_s": self.wall_s,
            "tokens_per_s": self.tokens / self.wall_s,
            "latencies_s": self.latencies,
            "equal_to_direct": equal,
            "compared_with_direct": compared,
            "answers": {str(i): a for i, a in sorted(self.answers.items())},
        }

    def equal_to(self, direct: Run | None) -> tuple[int, int]:
        """(answers equal to the direct engine's, answers that have a direct one to compare with): the direct run
        stops at ``time_limit``, so the later requests may have none."""
        if direct is None:
            return len(self.answers), len(self.answers)
        compared = [i for i in self.answers if i in direct.answers]
        return sum(direct.answers[i] == self.answers[i] for i in compared), len(compared)

    def row(self, direct: Run | None) -> str:
        rate = self.tokens / self.wall_s
        q = (
            statistics.quantiles(self.latencies, n=100, method="inclusive")
            if len(self.latencies) > 1
            else self.latencies * 99
        )
        overhead = f"{100 * (direct.tokens / direct.wall_s / rate - 1):+.1f} %" if direct else "–"
        equal, compared = self.equal_to(direct)
        return (
            f"| {self.label} | {len(self.answers)} | {self.tokens} | {rate:.1f} | {q[49]:.2f} | {q[89]:.2f} | "
            f"{max(self.latencies):.2f} | {overhead} | {equal}/{compared} |"
        )


def direct(model, ids: list[int], cfg) -> list[int]:
    return model.algorithm.generate(
        ids,
        max_new_tokens=cfg.max_tokens,
        sampling=SamplingParams(0.0),
        generator=torch.Generator().manual_seed(0),
        eos_ids=model.eos_ids,
    ).tokens


def chat_body(running: RunningServer, turns, cfg) -> dict:
    return {
        "model": running.server.model.name,
        "messages": turns,
        "max_tokens": cfg.max_tokens,
        "temperature": 0,
        "return_token_ids": True,
    }


def ask(http: httpx.Client, running: RunningServer, turns, cfg) -> list[int]:
    response = http.post(f"{running.url}/v1/chat/completions", json=chat_body(running, turns, cfg))
    if response.status_code != 200:
        raise RuntimeError(f"a good request got HTTP {response.status_code}: {response.text[:300]}")
    return response.json()["choices"][0]["token_ids"]


def paired_runs(running: RunningServer, conversations: list, prompts: list[list[int]], cfg) -> tuple[Run, Run]:
    """The direct engine and one HTTP client, request by request in turn: on a shared machine whose load drifts,
    each pair meets the same load, so their ratio is the server's overhead rather than the drift."""
    runs = {"direct": ([], {}, [0.0]), "server": ([], {}, [0.0])}
    start = time.perf_counter()
    with httpx.Client(timeout=None) as http:
        for i, (turns, ids) in enumerate(zip(conversations, prompts)):
            if time.perf_counter() - start > cfg.time_limit:
                break
            for key, call in (
                ("direct", lambda ids=ids: direct(running.server.model, ids, cfg)),
                ("server", lambda turns=turns: ask(http, running, turns, cfg)),
            ):
                latencies, answers, wall = runs[key]
                t0 = time.perf_counter()
                answers[i] = call()
                latencies.append(time.perf_counter() - t0)
                wall[0] += latencies[-1]
    return tuple(
        Run(label, lat, sum(map(len, ans.values())), wall[0], ans)
        for label, (lat, ans, wall) in zip(("engine, direct", "server, 1 client"), runs.values())
    )


def poisons(running: RunningServer, turns, cfg, max_body_bytes: int) -> list[tuple[str, dict]]:
    """Requests the server must refuse, each a good request with one field made unservable."""
    good = chat_body(running, turns, cfg)
    return [
        ("seed=2^64", {**good, "seed": 2**64}),
        ("temperature=1e-45", {**good, "temperature": 1e-45}),
        ("stop of 257 characters", {**good, "stop": ["x" * 257]}),
        ("5 stop strings", {**good, "stop": ["a", "b", "c", "d", "e"]}),
        ("body over max_body_bytes", {**good, "messages": [{"role": "user", "content": "x" * max_body_bytes}]}),
    ]


def poisoner(
    running: RunningServer, bodies: list[tuple[str, dict]], done: threading.Event, statuses: dict[str, list[int]]
) -> None:
    """Send ``bodies`` in turn until ``done``; the statuses they got, by kind."""
    with httpx.Client(timeout=None) as http:
        while not done.is_set():
            for kind, body in bodies:
                statuses.setdefault(kind, []).append(
                    http.post(f"{running.url}/v1/chat/completions", json=body).status_code
                )


def server_run(
    running: RunningServer, conversations: list, clients: int, cfg, poisoned: list[tuple[str, dict]] | None = None
) -> tuple[Run, dict[str, list[int]]]:
    """``clients`` clients share the requests; with ``poisoned``, one more client sends those bodies meanwhile.
    The run, and the statuses the poisoned requests got by kind."""
    pending, lock = list(enumerate(conversations)), threading.Lock()
    latencies, answers, start = [], {}, time.perf_counter()
    done, statuses = threading.Event(), {}

    def client() -> None:
        with httpx.Client(timeout=None) as http:
            while True:
                with lock:
                    if not pending or time.perf_counter() - start > cfg.time_limit:
                        return
                    i, turns = pending.pop(0)
                t0 = time.perf_counter()
                tokens = ask(http, running, turns, cfg)
                with lock:
                    latencies.append(time.perf_counter() - t0)
                    answers[i] = tokens

    threads = [threading.Thread(target=client) for _ in range(clients)]
    spoiler = threading.Thread(target=poisoner, args=(running, poisoned, done, statuses)) if poisoned else None
    for t in threads + ([spoiler] if spoiler else []):
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - start
    done.set()
    if spoiler:
        spoiler.join()
    label = f"server, {clients} client{'s' if clients > 1 else ''}" + (" + 1 poisoned" if poisoned else "")
    return Run(label, latencies, sum(map(len, answers.values())), wall, answers), statuses


def parse_args(argv: Sequence[str]) -> tuple[Any, Any]:
    """The load's config (the keys the server lacks) and the server's (every other key)."""
    load_keys = set(LoadConfig.__dataclass_fields__) - set(ServeConfig.__dataclass_fields__)
    load = parse_bench([a for a in argv if a.partition("=")[0] in load_keys], LoadConfig, USAGE)
    if load.requests < 1 or load.max_tokens < 1 or min(load.clients, default=0) < 1:
        raise OverrideError("requests, max_tokens and every clients entry must be >= 1")
    return load, parse_serve_args([a for a in argv if a.partition("=")[0] not in load_keys])


def _run(argv: list[str]) -> None:
    load, cfg = parse_args(argv)
    apply_threads(cfg)
    server = build_server(cfg)
    tokenizer = server.model.tokenizer
    conversations = [prompt_turns(c) for c in load_prompts(load.bench, n=load.requests, split="eval")]
    prompts = [render_prompt(tokenizer, turns) for turns in conversations]
    with RunningServer(server) as running:
        server_run(running, conversations[:1], 1, load)  # the HTTP path's first call pays for imports and sockets
        direct_engine, one_client = paired_runs(running, conversations, prompts, load)
        runs = [direct_engine, one_client] + [
            server_run(running, conversations, n, load)[0] for n in load.clients if n > 1
        ]
        health = httpx.get(f"{running.url}/health").json()  # the width policy and its measured costs, among others
        statuses = {}
        if load.poisoned:
            bodies = poisons(running, conversations[0], load, cfg.max_body_bytes)
            run, statuses = server_run(running, conversations, max(load.clients), load, bodies)
            runs.append(run)
    print(
        f"\n{cfg.algorithm} on {cfg.target}, {len(prompts)} requests of up to {load.max_tokens} tokens, greedy, "
        f"batch_size={server.model.batch_size}, threads={torch.get_num_threads()}\n"
    )
    print("| run | requests | tokens | tokens/s | p50 s | p90 s | max s | overhead vs direct | equal to direct |")
    print("|---|---|---|---|---|---|---|---|---|")
    for run in runs:
        print(run.row(None if run is direct_engine else direct_engine))
    if load.out:
        record = {
            "config": OmegaConf.to_container(load, resolve=True) if OmegaConf.is_config(load) else vars(load),
            "argv": argv,
            "batch_size": server.model.batch_size,
            "threads": torch.get_num_threads(),
            "machine": cpu_description(),
            "health": health,
            "exactness": server.model.exactness,
            "runs": [run.record(None if run is direct_engine else direct_engine) for run in runs],
            "poisoned_statuses": statuses,
        }
        Path(load.out).mkdir(parents=True, exist_ok=True)
        (Path(load.out) / "results.json").write_text(json.dumps(record, indent=2, default=str) + "\n")
    if statuses:
        refused = all(400 <= code < 500 for codes in statuses.values() for code in codes)
        print(
            f"\npoisoned requests beside the last run, HTTP statuses by kind (all 4xx: {'yes' if refused else 'NO'}):"
        )
        for kind, codes in statuses.items():
            print(f"- {kind}: {len(codes)} sent, " + ", ".join(f"{c} x{codes.count(c)}" for c in sorted(set(codes))))


def main(argv: list[str] | None = None) -> int:
    return run_cli(argv, _run, doc=__doc__, schema=LoadConfig)


if __name__ == "__main__":
    sys.exit(main())
