"""The API server's process: HTTP, the requests' state as the client sees it, the metrics.

The engine (scheduler, model runner, sampler, detokenization) runs in rank 0's process; the HTTP
server runs in a process of its own, started by rank 0 (serving.relay), so the two do not share one
Python interpreter: over HTTP, the event loop's work per token (server-sent events, JSON, socket
writes) no longer takes turns with the engine's step (vLLM runs its engine core apart for the same
reason). They talk over a pipe: requests and cancellations one way, each step's events the other.

`EngineClient` stands where the engine stood for serving.api (submit_all, cancel, load, metrics): each
job here mirrors the engine's (its tokens, log-probs and finish reason, from the events), and the
metrics (time to first token, inter-token latency, end to end) are measured here, where the client
sees the tokens.
"""
from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import sys
import time
import dataclasses
from dataclasses import dataclass

from torchmeg.batching.metrics import Metrics
from torchmeg.batching.scheduler import Job, QueueFull


class EngineClient:
    def __init__(self, conn, max_seqs: int, max_queue: int, max_len: int):
        self.conn, self.max_seqs, self.max_queue, self.max_len = conn, max_seqs, max_queue, max_len
        self.jobs: dict[int, Job] = {}
        self.next_key = 0
        self.metrics = Metrics()
        self.stats = dict(running=0, waiting=0, used=0, capacity=1, preemptions=0)
        self.closed = asyncio.Event()

    def start(self, loop) -> None:
        loop.add_reader(self.conn.fileno(), self._read)

    def submit_all(self, jobs: list[Job]) -> None:
        """A request's sequences (n of them) are admitted together or refused together: a request refused
        halfway would have started sequences nobody waits for."""
        held = len(self.jobs)
        if held + len(jobs) > self.max_seqs + self.max_queue:
            self.metrics.rejected.inc(len(jobs))
            raise QueueFull(f"{min(held, self.max_seqs)} sequences running and {held - min(held, self.max_seqs)} "
                            f"waiting (--max-queue {self.max_queue}); retry later")
        for job in jobs:
            key, self.next_key = self.next_key, self.next_key + 1
            job.key, job.arrived = key, time.monotonic()
            self.jobs[key] = job
            self.metrics.requests.inc()
            on_event, job.on_event = job.on_event, None
            try:
                self.conn.send(("submit", key, job))
            finally:
                job.on_event = on_event

    def cancel(self, job: Job) -> None:
        job.cancelled = True
        if getattr(job, "key", None) in self.jobs:
            self.conn.send(("cancel", job.key))

    def load(self) -> dict:
        return dict(self.metrics.set_load(**self.stats, admitted=len(self.jobs)), max_seqs=self.max_seqs)

    def _read(self) -> None:
        try:
            while self.conn.poll():
                steps, stats, events = self.conn.recv()
                self.metrics.steps.inc(steps)
                self.metrics.preemptions.inc(stats["preemptions"] - self.stats["preemptions"])
                self.stats = stats
                now = time.monotonic()
                for key, text, ids, reason, score, prompt_scores, cached in events:
                    self._event(self.jobs.get(key), now, text, ids, reason, score, prompt_scores, cached)
                    if reason is not None:
                        self.jobs.pop(key, None)
        except (EOFError, OSError):  # rank 0 is gone: nothing more will come
            asyncio.get_running_loop().remove_reader(self.conn.fileno())
            for job in list(self.jobs.values()):
                self._event(job, time.monotonic(), "", [], "error: the engine process ended", None, None, None)
            self.jobs.clear()
            self.closed.set()

    def _event(self, job, now, text, ids, reason, score, prompt_scores, cached: int | None) -> None:
        """`cached`: set on a sequence's first event (its prompt done): prompt tokens found in cached
        blocks (prefix caching)."""
        if job is None:
            return
        if cached is not None:
            self.metrics.prompt_tokens.inc(len(job.prompt))
            self.metrics.prefix_queries.inc(len(job.prompt))
            self.metrics.cached_prompt_tokens.inc(cached)
            job.cached_prompt = cached
        if prompt_scores is not None:
            job.prompt_token_logprobs = prompt_scores
        if ids:
            self.metrics.token(job, now)
            self.metrics.generation_tokens.inc(len(ids))
            if score is not None:
                job.token_logprobs.append(score)
            job.tokens.extend(ids)
        if reason is not None:
            job.finish_reason = reason
            self.metrics.finished(job, reason)
        job.on_event(text, list(ids), reason)


@dataclass
class FrontendSpec:
    """What the API process needs: the served model's tokenizer, its recipe (the chat template is built
    there: a compiled template does not travel), id and limits, where to listen, and the header to
    print once it does."""
    tokenizer: object
    cfg: object
    model_id: str
    max_len: int
    max_seqs: int
    max_queue: int
    host: str
    port: int
    drain_timeout: float
    header: str
    sampling_defaults: dict = dataclasses.field(default_factory=dict)  # (inference.sampling_defaults)


def main(conn, spec: FrontendSpec) -> None:
    """The API process: uvicorn until SIGTERM (rank 0 forwards its own), draining up to the deadline;
    exits when rank 0's pipe closes."""
    import uvicorn  # lazy: the serve extra (this process only)
    from torchmeg.config.errors import ConfigError  # lazy: this process only
    from torchmeg.data.chat import chat_template
    from torchmeg.serving.api import Served, build_app  # lazy: imports fastapi
    try:
        template, template_error = chat_template(spec.cfg), ""
    except ConfigError as e:
        template, template_error = None, str(e)
    client = EngineClient(conn, spec.max_seqs, spec.max_queue, spec.max_len)
    server = None

    @contextlib.asynccontextmanager
    async def lifespan(app):
        client.start(asyncio.get_running_loop())
        asyncio.get_running_loop().create_task(_end_with_engine(client, lambda: server))
        print(spec.header, file=sys.stderr, flush=True)
        yield

    app = build_app(Served(client, spec.tokenizer, template, template_error, spec.model_id, spec.max_len,
                            spec.sampling_defaults), lifespan)
    logging.getLogger("uvicorn.error").setLevel(logging.WARNING)
    for sig in (signal.SIGTERM, signal.SIGINT):  # (uvicorn drains, then raises it again: end normally)
        signal.signal(sig, lambda *_: None)
    server = uvicorn.Server(uvicorn.Config(app, host=spec.host, port=spec.port, log_level="warning", access_log=False,
                                           timeout_graceful_shutdown=spec.drain_timeout))
    server.run()
    if client.closed.is_set():
        os._exit(1)  # (the engine ended first: rank 0 says why)


async def _end_with_engine(client: EngineClient, server) -> None:
    await client.closed.wait()
    server().should_exit = True
