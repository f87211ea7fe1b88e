"""The server's Prometheus metrics (GET /metrics), with prometheus_client, named as vLLM names its
own with torchmeg's prefix: requests running and waiting, KV cache use, prompt and generation
tokens, finished requests by reason, and the latency histograms a serving dashboard plots: time to
first token, inter-token latency, end-to-end request latency. Each server has its own registry.

prometheus_client is the serve extra's, imported when a server builds its `Metrics`: the engine that
GRPO's rollouts run in the training processes counts nothing (`NoMetrics`, the same calls), so the
core install trains without it.
"""
from __future__ import annotations

import time

from torchmeg.config.extras import need

# vLLM's buckets (seconds)
_TTFT = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0)
_ITL = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0)
_E2E = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0, 480.0, 960.0)


class Metrics:
    def __init__(self):
        prom = need("prometheus_client", "serve", "the server's /metrics")
        CollectorRegistry, Counter, Gauge, Histogram = (prom.CollectorRegistry, prom.Counter, prom.Gauge,
                                                        prom.Histogram)
        self._render = prom.generate_latest
        r = self.registry = CollectorRegistry()
        self.running = Gauge("torchmeg_num_requests_running", "Sequences in the running batch", registry=r)
        self.waiting = Gauge("torchmeg_num_requests_waiting", "Sequences waiting for a slot", registry=r)
        self.admitted = Gauge("torchmeg_num_requests_admitted", "Sequences the API process holds until their last "
                              "event (running, waiting, or on their way to the engine): what --max-queue bounds",
                              registry=r)
        self.cache_usage = Gauge("torchmeg_kv_cache_usage_perc", "Fraction of the KV pool's blocks in use", registry=r)
        self.requests = Counter("torchmeg_requests", "Sequences submitted", registry=r)
        self.rejected = Counter("torchmeg_rejected", "Sequences refused: the queue was full", registry=r)
        self.prompt_tokens = Counter("torchmeg_prompt_tokens", "Prompt tokens prefilled", registry=r)
        self.cached_prompt_tokens = Counter("torchmeg_prefix_cache_hits", "Prompt tokens found in cached KV blocks "
                                            "instead of computed (prefix caching)", registry=r)
        self.prefix_queries = Counter("torchmeg_prefix_cache_queries", "Prompt tokens looked up in the prefix cache",
                                      registry=r)
        self.preemptions = Counter("torchmeg_num_preemptions", "Sequences preempted: the KV pool ran out of blocks "
                                   "(recomputed later)", registry=r)
        self.generation_tokens = Counter("torchmeg_generation_tokens", "Tokens generated (completion tokens, an end-of-sequence token included)", registry=r)
        self.steps = Counter("torchmeg_steps", "Engine steps (forwards of the continuous batch)", registry=r)
        self.success = Counter("torchmeg_request_success", "Sequences finished, by reason", ["finished_reason"],
                               registry=r)
        self.ttft = Histogram("torchmeg_time_to_first_token_seconds", "Submission to first token", buckets=_TTFT,
                              registry=r)
        self.itl = Histogram("torchmeg_inter_token_latency_seconds", "Between a sequence's tokens", buckets=_ITL,
                             registry=r)
        self.e2e = Histogram("torchmeg_e2e_request_latency_seconds", "Submission to the last token", buckets=_E2E,
                             registry=r)

    def set_load(self, running: int, waiting: int, used: int, capacity: int, admitted: int | None = None,
                 preemptions: int = 0) -> dict:
        """The gauges, from the engine's counts (`used` of `capacity` KV blocks); `admitted`: the API
        process's own count (serving.frontend)."""
        self.admitted.set(running + waiting if admitted is None else admitted)
        self.running.set(running)
        self.waiting.set(waiting)
        self.cache_usage.set(used / capacity)
        return dict(running=running, waiting=waiting)

    def token(self, job, now: float) -> None:
        (self.ttft.observe(now - job.arrived) if not job.last else self.itl.observe(now - job.last))
        job.last = now

    def finished(self, job, reason: str) -> None:
        self.success.labels(finished_reason=reason.split(":")[0]).inc()
        self.e2e.observe(time.monotonic() - job.arrived)

    def render(self) -> bytes:
        return self._render(self.registry)


class _Nothing:
    def inc(self, *_):
        pass

    def observe(self, *_):
        pass

    def set(self, *_):
        pass

    def labels(self, **_):
        return self


class NoMetrics:
    """Metrics' calls, counting nothing: an engine that no server exports (GRPO's rollouts)."""
    rejected = requests = prompt_tokens = cached_prompt_tokens = generation_tokens = steps = success = _Nothing()
    prefix_queries = preemptions = _Nothing()

    def set_load(self, running: int, waiting: int, used: int, capacity: int, admitted: int | None = None,
                 preemptions: int = 0) -> dict:
        return dict(running=running, waiting=waiting)

    def token(self, job, now: float) -> None:
        job.last = now

    def finished(self, job, reason: str) -> None:
        pass
