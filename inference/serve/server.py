"""Run the server: from the command line (``python -m inference.serve ...``), or in this process on a thread
(tests, ``benchmarks/serve_load.py``)."""

from __future__ import annotations

import logging
import socket
import sys
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import uvicorn
from fastapi import FastAPI

from core.overrides import run_cli
from inference.algorithms import ALGORITHMS
from inference.algorithms.options import apply_threads
from inference.drafters import LoadedModel
from inference.serve.app import create_app
from inference.serve.config import TIME_LIMITS_HELP, USAGE, ServeConfig, parse_args
from inference.serve.engine import ServedModel, load_served_model, warm_up
from inference.serve.metrics import ServeMetrics
from inference.serve.scheduler import Scheduler

log = logging.getLogger(__name__)


@dataclass
class Server:
    app: FastAPI
    model: ServedModel
    scheduler: Scheduler
    metrics: ServeMetrics

    def close(self, timeout: float = 10.0) -> None:
        """In order: the scheduler (requests in flight and waiting end, 503; the worker stops within
        ``timeout``), then the model (algorithm, then adapter, then the runner is free). A worker that did not
        stop still holds the model, which is then left open rather than closed under it."""
        if self.scheduler.close(timeout):
            self.model.close()
        else:
            log.warning("the engine did not stop within %.0f s; its algorithm and adapter are left open", timeout)


def build_server(cfg: Any, *, target: LoadedModel | None = None, drafters: dict[str, Any] | None = None) -> Server:
    """Load the model (or take ``target`` / ``drafters``, by drafter kind), start the engine's worker, and
    build the app."""
    metrics = ServeMetrics(cfg.algorithm)
    model = load_served_model(cfg, target=target, drafters=drafters, on_decision=metrics.decision)
    try:
        if cfg.warmup and model.adapter is None:  # the adapter learns from live traffic only
            warm_up(model)
    except BaseException:
        model.close()
        raise
    scheduler = Scheduler(
        model, metrics, max_queue=cfg.max_queue, max_queue_wait_s=cfg.max_queue_wait_s, stall_s=cfg.stall_s
    )
    return Server(create_app(model, scheduler, metrics, max_body_bytes=cfg.max_body_bytes), model, scheduler, metrics)


def bind(host: str, port: int) -> socket.socket:
    """The listening socket, bound now: a port in use fails before the model loads; port 0 picks a free one."""
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as exc:
        sock.close()
        raise OSError(f"cannot listen on {host}:{port} ({exc.strerror}); choose another port=") from None
    return sock


def uvicorn_config(app: FastAPI | None, log_level: str, shutdown_timeout_s: float) -> uvicorn.Config:
    """uvicorn's settings: at shutdown, open connections get ``shutdown_timeout_s`` to finish, then are closed."""
    return uvicorn.Config(app, log_level=log_level, timeout_graceful_shutdown=shutdown_timeout_s)


class EngineFirstUvicorn(uvicorn.Server):
    """uvicorn that, told to exit (SIGINT, SIGTERM, ``should_exit``), first closes the engine's queue: the requests
    waiting and running are answered 503 at once (they stop at their next token) instead of being served while
    connections drain."""

    def __init__(self, config: uvicorn.Config, server: Server):
        super().__init__(config)
        self.engine = server

    async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
        self.engine.scheduler.close(timeout=0)  # ends the requests; Server.close() later waits for the worker
        await super().shutdown(sockets)


class RunningServer:
    """A server on a free port of ``host``, served by uvicorn on a thread of this process; ``close()`` stops it."""

    def __init__(self, server: Server, host: str = "127.0.0.1", port: int = 0, log_level: str = "warning"):
        self.server = server
        self.sock = bind(host, port)
        self.host, self.port = host, self.sock.getsockname()[1]
        self.uvicorn = EngineFirstUvicorn(uvicorn_config(server.app, log_level, shutdown_timeout_s=1), server)
        self.thread = threading.Thread(target=self.uvicorn.run, kwargs={"sockets": [self.sock]}, daemon=True)
        self.thread.start()
        deadline = time.monotonic() + 30
        while not self.uvicorn.started:
            if not self.thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError("the server did not start")
            time.sleep(0.01)

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def close(self) -> None:
        """The server first (its handlers answer the requests it ends), then uvicorn and the socket."""
        self.server.close()
        self.uvicorn.should_exit = True
        self.thread.join(10)
        self.sock.close()

    def __enter__(self) -> RunningServer:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _run(argv: list[str]) -> None:
    cfg = parse_args(argv)
    apply_threads(cfg)
    sock = bind(cfg.host, cfg.port)
    server = build_server(cfg)
    host, port = sock.getsockname()[:2]
    print(
        f"serving '{server.model.name}' with {cfg.algorithm} on http://{host}:{port} (OpenAI API under /v1; "
        "/health, /metrics)",
        file=sys.stderr,
        flush=True,
    )
    try:
        EngineFirstUvicorn(uvicorn_config(server.app, cfg.log_level, cfg.shutdown_timeout_s), server).run(
            sockets=[sock]
        )
    finally:
        server.close()


def main(argv: Sequence[str] | None = None) -> int:
    doc = f"usage: {USAGE}\nalgorithms: {', '.join(ALGORITHMS)}\n{TIME_LIMITS_HELP}"
    return run_cli(argv, _run, doc=doc, schema=ServeConfig)
