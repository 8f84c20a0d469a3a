"""The server's command line: the keys of ``inference.evaluate`` for one algorithm, plus where and how to serve."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from core.overrides import OverrideError
from inference.engine_args import (
    EngineArgs,
    check_algorithm_options,
    check_placement,
    parse_engine_cli,
    parse_variant,
    with_overrides,
)
from inference.round_observers import check_observer
from inference.serve.limits import DEFAULT_MAX_BODY_BYTES

USAGE = (
    "python -m inference.serve target=smollm2 drafters=DIR algorithm=eagle3_tree host=127.0.0.1 port=8000 "
    "[any option of inference.evaluate, e.g. adapt=bandit or algorithm=sps@gamma=3]"
)

TIME_LIMITS_HELP = (
    "time limits, in seconds: max_queue_wait_s=120 (a request not started by then gets 503), "
    "stall_s=60 (/health answers 503 while the engine has work but no token for this long), "
    "draft_timeout_s=60 (executor=multiprocess: a slower draft call fails its request and the draft "
    "process restarts), shutdown_timeout_s=10 (at SIGTERM, after the queue is answered 503, open "
    "connections get this long)"
)


@dataclass
class ServeConfig(EngineArgs):
    algorithm: str = "ar"  # NAME or NAME@key=value[@key=value], as a variant of inference.evaluate
    host: str = "127.0.0.1"
    port: int = 8000  # 0 = any free port (printed at start)
    model_name: str | None = None  # the "model" clients send; default: the target's name (its folder's name)
    max_new_tokens: int = 256  # max_tokens of a request that sets none (capped by what the context leaves)
    # temperature, top_k and top_p (and the algorithm variant's @temperature=...) are what a request that sets none
    # samples with; OpenAI's default temperature is 1.0, so the server's is too
    temperature: float = 1.0
    # a request that sets no seed draws one from a stream seeded by this; None: by the OS's entropy
    seed: int | None = None
    # ar, sps, dflash, peagle, eagle3_tree, specblock_tree (adapt= too), self_draft: rows decoded side by side on the
    # engine loop (continuous batching); 0 = auto: 8 on a CPU (exact mode: a row's answer is the request's own) and in fp32 elsewhere, 1 in a
    # GPU's bf16, where the batched path is not batch-invariant. Other algorithms serve one at a time (batch_size > 1
    # is refused for them).
    batch_size: int = 0
    # batched sps and self_draft: one engine step scores at most this many target rows (0 = no cap), so as requests
    # join, each drafts fewer tokens, down to none (an AR step, still lossless); refused where it does nothing
    max_step_tokens: int = 0
    # batched sps and self_draft: full (every row drafts what it drafts alone) | cost (each step's widths maximise expected tokens per
    # second from this host's measured forward costs, measured at start-up, and each row's acceptance so far; down
    # to AR steps under load, still lossless)
    width_policy: str = "full"
    max_queue: int = 64  # requests waiting for the engine; one more is answered 429 (with Retry-After)
    max_queue_wait_s: float = 120.0  # a request not started after waiting this long is answered 503 (Retry-After)
    # /health answers 503 ("stalled") while the engine has work but made no progress (no token) for this long
    stall_s: float = 60.0
    # executor=multiprocess: a draft-process call that takes longer fails its request (500); the draft process is
    # stopped and a new one starts with the next request (in-process executors cannot be interrupted: see stall_s)
    draft_timeout_s: float = 60.0
    # on SIGINT/SIGTERM the queue and running requests are answered 503 at once; open connections then get this
    # long to finish before they are closed
    shutdown_timeout_s: float = 10.0
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES  # a larger request body is answered 413
    warmup: bool = True  # one short generation before serving: the first request should not pay for allocation
    log_level: str = "warning"  # uvicorn's: critical | error | warning | info | debug


def parse_args(argv: Sequence[str]) -> Any:
    """A checked ServeConfig; every bad key or value fails here, before any model loads."""
    for arg in argv:  # before parsing: a list would fail there with a vaguer message
        key, _, value = arg.partition("=")
        if key == "algorithms" or (key == "algorithm" and ("," in value or value.startswith("["))):
            raise OverrideError(
                f"{arg}: a server runs one algorithm; write algorithm=NAME and start one server per algorithm"
            )
    cfg, given = parse_engine_cli(argv, ServeConfig, USAGE)
    for key, low in (("max_new_tokens", 1), ("max_queue", 1), ("batch_size", 0), ("max_step_tokens", 0)):
        if cfg[key] < low:
            auto = " (0 = auto)" if key == "batch_size" else ""
            raise OverrideError(f"{key}={cfg[key]} must be >= {low}{auto}")
    for key in ("max_queue_wait_s", "stall_s", "draft_timeout_s", "shutdown_timeout_s"):
        if not cfg[key] > 0:
            raise OverrideError(f"{key}={cfg[key]} must be > 0 seconds")
    if cfg.width_policy not in ("full", "cost"):
        raise OverrideError(f"width_policy={cfg.width_policy} is unknown; use width_policy=full or width_policy=cost")
    if cfg.width_policy == "cost" and cfg.max_step_tokens:
        raise OverrideError("width_policy=cost chooses every step's widths itself; drop max_step_tokens")
    if cfg.max_body_bytes < 1024:
        raise OverrideError(f"max_body_bytes={cfg.max_body_bytes} leaves no room for a request; use at least 1024")
    if not 0 <= cfg.port <= 65535:
        raise OverrideError(f"port={cfg.port} is not a TCP port; use 1-65535 (or 0 for any free port)")
    # an unknown algorithm, a bad variant key and an option the algorithm does not read fail now; the sampling
    # settings are defaults for requests (which may sample), so top_k/top_p/seed are refused per request instead
    check_algorithm_options(cfg, given, [cfg.algorithm], sampling_defaults=True)
    check_placement(cfg)
    variant = with_overrides(cfg, parse_variant(cfg.algorithm)[1], cfg.algorithm)
    try:
        check_observer(variant.adapt)
    except ValueError as exc:
        raise OverrideError(str(exc)) from None
    if variant.max_new_tokens < 1:  # the default budget of every request
        raise OverrideError(
            f"algorithm variant '{cfg.algorithm}': max_new_tokens={variant.max_new_tokens} must be >= 1"
        )
    return cfg
