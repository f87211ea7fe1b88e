"""The serving engine: continuous batching, sequences join the running batch at any step and leave
it when done. One direction of calls, one module each:

    API (serving.api) -> Engine.submit / cancel            (the server's threads, under `cond`)
    Engine.step: Scheduler.schedule -> Plan               (batching.scheduler, batching.blocks; under `cond`)
                 ModelRunner.forward(plan) -> logits      (batching.runner, batching.paged)
                 sample_and_score                         (batching.sampler)
                 OutputProcessor.advance per sequence     (batching.output; outside `cond`)

A request's tokens are a function of (its prompt, its sampling, its seed) only: the same random
streams as torchmeg.batching.generation, so it gets the tokens `torchmeg.generate` gives it alone, at
any concurrency. Under tensor parallel rank 0 decides each step and broadcasts the plan
(`channel`); the other ranks run the same forwards (batching.runner.follow) and sample nothing.
"""
from __future__ import annotations

import logging
import threading
import time

import torch

from torchmeg.batching.blocks import BlockPool, pool_blocks
from torchmeg.batching.metrics import NoMetrics
from torchmeg.batching.output import OutputProcessor
from torchmeg.batching.runner import ModelRunner
from torchmeg.batching.sampler import prompt_logprobs, sample_and_score
from torchmeg.batching.scheduler import Job, Plan, Scheduler

log = logging.getLogger("torchmeg.serve")


class Engine:
    def __init__(self, model, tokenizer, device, max_seqs: int, max_len: int, max_queue: int,
                 prefill_tokens: int = 2048, channel=None, metrics=None, prefix_caching: bool = True,
                 num_blocks: int = 0, static_decode: bool = False):
        """`num_blocks`: the KV pool's blocks (batching.blocks: the null block included; 0: enough for
        `max_seqs` sequences of `max_len`, what serving.kv_budget sizes it at most). `static_decode`:
        every decode step through one compiled step, a CUDA graph on a GPU (batching.static_decode)."""
        self.tok, self.max_seqs, self.max_len = tokenizer, max_seqs, max_len
        self.pool = BlockPool(num_blocks or pool_blocks(max_seqs, max_len))
        if self.pool.usable < self.pool.blocks_for(max_len):
            raise ValueError(f"a KV pool of {self.pool.usable} blocks cannot hold one sequence of {max_len} positions")
        self.runner = ModelRunner(model, device, self.pool.num_blocks, max_len, eos_id=tokenizer.eos_id,
                                  static_decode=static_decode, max_seqs=max_seqs)
        self.scheduler = Scheduler(max_seqs, max_queue, prefill_tokens, self.pool,
                                   prefix_caching=prefix_caching and not self.runner.own_cache)
        self.metrics = metrics if metrics is not None else NoMetrics()  # a server's: batching.metrics.Metrics
        self.output = OutputProcessor(tokenizer, self.metrics)
        self.channel = channel  # TP: sends each Plan to the other ranks
        self.cond = threading.Condition()

    # the parts' state, read by tests and the API
    running = property(lambda self: self.scheduler.running)
    waiting = property(lambda self: self.scheduler.waiting)
    cache = property(lambda self: self.runner.cache)
    own_cache = property(lambda self: self.runner.own_cache)
    own = property(lambda self: self.runner.own)

    # ---- called from the server's threads ----------------------------------------------------
    def submit(self, job: Job) -> None:
        job.arrived = time.monotonic()
        with self.cond:
            try:
                self.scheduler.add(job)
            except Exception:
                self.metrics.rejected.inc()
                raise
            self.metrics.requests.inc()
            self.cond.notify()

    def cancel(self, job: Job) -> None:
        with self.cond:
            job.cancelled = True
            self.cond.notify()

    def stats(self) -> dict:
        """Sequences running and waiting, KV blocks in use of the pool's, preemptions so far."""
        with self.cond:
            return dict(running=len(self.scheduler.running), waiting=len(self.scheduler.waiting),
                        used=self.pool.used(), capacity=self.pool.usable, preemptions=self.scheduler.preemptions)

    def load(self) -> dict:
        return dict(self.metrics.set_load(**self.stats()), max_seqs=self.max_seqs)

    def reserve(self) -> int:
        return self.runner.reserve()

    # ---- the engine's thread -----------------------------------------------------------------
    def serve(self, stopping: threading.Event, heartbeat_s: float = 5.0, on_step=None) -> None:
        """Step while there is work; after `stopping` is set, finish what was admitted, then stop
        (and tell the other ranks). Idle under TP: a heartbeat keeps their collectives in time.
        `on_step()` after each step (serving.relay sends the step's events in one message)."""
        while True:
            with self.cond:
                if not self.scheduler.busy():
                    if stopping.is_set():
                        break
                    self.cond.wait(timeout=heartbeat_s)
                    if not self.scheduler.busy():
                        if self.channel is not None and not stopping.is_set():
                            self.channel(Plan())
                        continue
            self.step()
            if on_step is not None:
                on_step()
        if self.channel is not None:
            self.channel(Plan(stop=True))

    @torch.no_grad()
    def step(self) -> None:
        with self.cond:
            preempted = self.scheduler.preemptions
            plan, chunks, decoding = self.scheduler.schedule()
            preempted = self.scheduler.preemptions - preempted
            dropped = self.scheduler.take_dropped()
        for job in dropped:  # cancelled: its end is an event like any other (vLLM's "abort"), so the
            self.output.finish(job, "abort")  # API process and the relay forget it and its place is free
        self.metrics.preemptions.inc(preempted)
        if not plan.runs():
            return
        # a chunk that completes its context gives its sequence's next token (a prompt's: its first)
        done = [i for i, j in enumerate(chunks) if not j.prefilling]
        jobs = [chunks[i] for i in done] + decoding
        try:
            if self.channel is not None:
                self.channel(plan)
            logits = self.runner.forward(plan)
            want = done + list(range(len(chunks), len(chunks) + len(decoding)))
            # (a run of rows is a slice: no index to upload, as in every step that only decodes)
            if want and want == list(range(want[0], want[0] + len(want))):
                rows = logits[want[0]:want[-1] + 1]
            else:
                rows = logits[torch.tensor(want, dtype=torch.long, device=logits.device)]
            # (one upload, one host read: the tokens with the log-probs asked for)
            new, scores = sample_and_score(rows, jobs) if jobs else ([], [])
            for (slot, start, _), job in zip(plan.prefill, chunks):
                if slot in self.runner.full:
                    job.prompt_token_logprobs += prompt_logprobs(self.runner.full[slot], job, start)
        except Exception as e:  # noqa: BLE001 - the requests of this step learn why; the server goes on
            log.exception("step failed")
            for job in chunks + decoding:
                self.output.finish(job, f"error: {type(e).__name__}: {e}")
            if self.channel is not None:
                raise  # the other ranks' caches no longer match: end the job
            return
        self.metrics.steps.inc()
        self.metrics.prompt_tokens.inc(sum(len(c[2]) for c in plan.prefill))
        self.metrics.cached_prompt_tokens.inc(plan.hits)
        self.metrics.prefix_queries.inc(plan.queries)
        for job, t, score in zip(jobs, new, scores):
            if job.cancelled:
                continue
            if job.max_tokens == 0:  # (echo with max_tokens 0: the prompt scored, nothing generated)
                self.output.finish(job, "length")
            else:
                self.output.advance(job, t, score)
