"""The server's Prometheus metrics (``GET /metrics``), in a registry of its own so servers in one process (tests,
benchmarks) never share counters."""

from __future__ import annotations

import time

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from inference.algorithms.base import GenerationStats

TAU_BUCKETS = (1.0, 1.25, 1.5, 1.75, 2.0, 2.5, 3.0, 3.5, 4.0, 5.0, 6.0, 8.0)
ACCEPT_BUCKETS = tuple(float(n) for n in range(0, 9)) + (12.0, 16.0)
SECONDS_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)


class ServeMetrics:
    def __init__(self, algorithm: str):
        r = self.registry = CollectorRegistry()
        label = {"algorithm": algorithm}
        self.requests = Counter(
            "spectrain_requests", "HTTP requests by endpoint and status code", ["endpoint", "status"], registry=r
        )
        self.prompt_tokens = Counter("spectrain_prompt_tokens", "prompt tokens of finished requests", registry=r)
        self.completion_tokens = Counter(
            "spectrain_completion_tokens", "tokens returned by finished requests", registry=r
        )
        self.target_forwards = Counter("spectrain_target_forwards", "target forwards of finished requests", registry=r)
        self.accepted_tokens = Counter(
            "spectrain_accepted_draft_tokens", "drafted tokens the target accepted", registry=r
        )
        self.tau = Histogram(
            "spectrain_tau", "new tokens per target forward, per finished request", buckets=TAU_BUCKETS, registry=r
        )
        self.accept_length = Histogram(
            "spectrain_acceptance_length",
            "drafted tokens kept per verification round",
            buckets=ACCEPT_BUCKETS,
            registry=r,
        )
        self.latency = Histogram(
            "spectrain_request_seconds", "from queued to last token", buckets=SECONDS_BUCKETS, registry=r
        )
        self.first_token = Histogram(
            "spectrain_time_to_first_token_seconds", "from queued to first token", buckets=SECONDS_BUCKETS, registry=r
        )
        self.queue_depth = Gauge("spectrain_queue_depth", "requests waiting for the engine", registry=r)
        self.running = Gauge("spectrain_running", "requests the engine is generating", registry=r)
        self.cancelled = Counter(
            "spectrain_cancelled", "requests dropped before their end (client went away)", registry=r
        )
        self.failed = Counter("spectrain_failed", "requests the engine failed on", registry=r)
        self.decisions = Counter(
            "spectrain_adapter_decisions", "serving-time adapter decisions by arm", ["arm"], registry=r
        )
        Gauge("spectrain_info", "what this server runs", list(label), registry=r).labels(**label).set(1)

    def finished(
        self,
        prompt_tokens: int,
        completion_tokens: int,
        stats: GenerationStats,
        submitted: float,
        first_token_s: float | None,
    ) -> None:
        """Count one finished request (called on the engine's thread); ``submitted`` is its perf_counter time
        of queueing, ``first_token_s`` how long its first token took from there."""
        self.prompt_tokens.inc(prompt_tokens)
        self.completion_tokens.inc(completion_tokens)
        self.target_forwards.inc(stats.target_forwards)
        self.accepted_tokens.inc(stats.accepted_draft_tokens)
        if stats.target_forwards:
            self.tau.observe(stats.tau)
        for kept, rounds in enumerate(stats.accepted_hist):
            for _ in range(rounds):
                self.accept_length.observe(kept)
        self.latency.observe(time.perf_counter() - submitted)
        if first_token_s is not None:
            self.first_token.observe(first_token_s)

    def decision(self, row: dict) -> None:
        """One adapter decision (the row ``end_query`` returned)."""
        if "arm" in row:
            self.decisions.labels(arm=str(row["arm"])).inc()

    def render(self) -> bytes:
        return generate_latest(self.registry)
