"""Continuous batching: sequences join the running batch at any step and leave it when done.

Every step (`Engine.step`): requests that were cancelled leave; waiting requests are admitted into
free slots and prefilled, one forward each over their own prompt (no padding), up to a budget of
prompt tokens per step, so a long prompt does not stall the running sequences for more than one
step; then every running sequence decodes one token in one forward over the slot cache
(serving.slots). The logits of all of them are sampled together by each request's own parameters,
and the new tokens are read to the host once (the one sync that streams them).

A request's tokens are a function of (its prompt, its sampling, its seed) only: the same random
streams as torchmeg.inference.engine (prompt tokens, sample index, step), so it gets the tokens
`torchmeg.generate` gives it alone, at any concurrency.

Under tensor parallel rank 0 decides each step and broadcasts what the forwards are (`Plan`); the
other ranks run the same forwards (`follow`) and sample nothing (rank 0 streams the tokens).
"""
from __future__ import annotations

import heapq
import logging
import threading
from collections import deque
from dataclasses import dataclass, field
from typing import Callable

import torch

from torchmeg.config.errors import ConfigError
from torchmeg.inference.engine import Sampling, last_only, row_streams, sample
from torchmeg.models.kv_cache import KVCache
from torchmeg.serving.slots import SlotCache

log = logging.getLogger("torchmeg.serve")


class QueueFull(Exception):
    pass


@dataclass
class Job:
    """One sequence to generate. `on_event(text, token_ids, finish_reason)` is called from the
    engine's thread with each step's new text (and the finish reason at the end: "stop" | "length",
    or "error: ..." when the step failed)."""
    prompt: list[int]
    max_tokens: int
    sampling: Sampling
    on_event: Callable[[str, list[int], str | None], None]
    stop: tuple[str, ...] = ()
    eos_ids: frozenset = frozenset()
    sample_index: int = 0
    cancelled: bool = False
    presence: float = 0.0        # OpenAI's presence / frequency penalties on the tokens generated so far
    frequency: float = 0.0
    logprobs: int = -1           # >= 0: each token's log-probability and the top this-many (-1: none)
    prompt_logprobs: bool = False  # the prompt's tokens' too (echo), with the same top count
    # the engine's
    slot: int = -1
    tokens: list[int] = field(default_factory=list)
    sent: int = 0            # characters of the text already given to on_event
    stream: int = 0          # its random stream (inference.engine.row_streams)
    finish_reason: str | None = None
    token_logprobs: list = field(default_factory=list)  # per generated token: (logprob, [(token, logprob)...])
    prompt_token_logprobs: list = field(default_factory=list)  # per prompt token after the first, alike


@dataclass
class Plan:
    """One step's forwards: prompts to prefill into their slots, then one decode token per slot;
    `full`: the slots whose prefill keeps every position's logits (prompt log-probs)."""
    prefill: list[tuple[int, list[int]]] = field(default_factory=list)
    full: list[int] = field(default_factory=list)
    rows: list[int] = field(default_factory=list)
    tokens: list[int] = field(default_factory=list)
    starts: list[int] = field(default_factory=list)
    stop: bool = False


class Engine:
    def __init__(self, model, tokenizer, device, max_seqs: int, max_len: int, max_queue: int,
                 prefill_tokens: int = 4096, channel=None):
        self.model, self.tok, self.device = model, tokenizer, torch.device(device)
        self.cache = SlotCache(max_seqs, max_len, device)
        self.max_seqs, self.max_len, self.max_queue, self.prefill_tokens = max_seqs, max_len, max_queue, prefill_tokens
        self.channel = channel  # TP: sends each Plan to the other ranks
        self.free = list(range(max_seqs))
        self.running: dict[int, Job] = {}
        self.waiting: deque[Job] = deque()
        self.cond = threading.Condition()
        self.counters = dict(requests=0, rejected=0, prompt_tokens=0, generation_tokens=0, steps=0)
        self._last_only = last_only(model)
        self.own_cache = bool(getattr(model, "keeps_own_cache", False))
        self.own: dict[int, KVCache] = {}  # slot -> its sequence's cache, when the model keeps its own

    # ---- called from the server's threads ----------------------------------------------------
    def submit(self, job: Job) -> None:
        with self.cond:
            if len(self.waiting) >= self.max_queue:
                self.counters["rejected"] += 1
                raise QueueFull(f"{len(self.running)} sequences running and {len(self.waiting)} waiting "
                                f"(--max-queue {self.max_queue}); retry later")
            self.counters["requests"] += 1
            self.waiting.append(job)
            self.cond.notify()

    def cancel(self, job: Job) -> None:
        with self.cond:
            job.cancelled = True
            self.cond.notify()

    def load(self) -> dict:
        return dict(self.counters, running=len(self.running), waiting=len(self.waiting), max_seqs=self.max_seqs)

    # ---- the engine's thread -----------------------------------------------------------------
    def serve(self, stopping: threading.Event, heartbeat_s: float = 5.0) -> None:
        """Step while there is work; after `stopping` is set, finish what was admitted, then stop
        (and tell the other ranks). Idle under TP: a heartbeat keeps their collectives in time."""
        while True:
            with self.cond:
                if not (self.waiting or self.running):
                    if stopping.is_set():
                        break
                    self.cond.wait(timeout=heartbeat_s)
                    if not (self.waiting or self.running):
                        if self.channel is not None and not stopping.is_set():
                            self.channel(Plan())
                        continue
            self.step()
        if self.channel is not None:
            self.channel(Plan(stop=True))

    @torch.no_grad()
    def step(self) -> None:
        with self.cond:
            for slot, job in list(self.running.items()):
                if job.cancelled:
                    self._free(job)
            admitted, budget = [], self.prefill_tokens
            while self.waiting and self.free:
                job = self.waiting[0]
                if job.cancelled:
                    self.waiting.popleft()
                    continue
                if admitted and len(job.prompt) > budget:
                    break
                self.waiting.popleft()
                job.slot = heapq.heappop(self.free)
                job.stream = int(row_streams([job.prompt], job.sample_index)[0])
                budget -= len(job.prompt)
                admitted.append(job)
            decoding = [j for j in self.running.values()]
            for job in admitted:
                self.running[job.slot] = job
        plan = Plan(prefill=[(j.slot, j.prompt) for j in admitted], full=[j.slot for j in admitted if j.prompt_logprobs],
                    rows=[j.slot for j in decoding],
                    tokens=[j.tokens[-1] for j in decoding],
                    starts=[len(j.prompt) + len(j.tokens) - 1 for j in decoding])
        jobs = admitted + decoding
        try:
            if self.channel is not None:
                self.channel(plan)
            logits = self.forward(plan)
            new = self._sample(logits, jobs)
            scores = self._logprobs(logits, jobs, new)
            prompt_scores = {j.slot: self._prompt_logprobs(j) for j in admitted if j.prompt_logprobs}
        except Exception as e:  # noqa: BLE001 - the requests of this step learn why; the server goes on
            log.exception("step failed")
            with self.cond:
                for job in jobs:
                    self._finish(job, f"error: {type(e).__name__}: {e}")
            if self.channel is not None:
                raise  # the other ranks' caches no longer match: end the job
            return
        self.counters["steps"] += 1
        self.counters["prompt_tokens"] += sum(len(j.prompt) for j in admitted)
        with self.cond:
            for job in admitted:
                job.prompt_token_logprobs = prompt_scores.get(job.slot, [])
            for job, t, score in zip(jobs, new, scores):
                if job.cancelled:
                    continue
                if job.max_tokens == 0:  # (echo with max_tokens 0: the prompt scored, nothing generated)
                    self._finish(job, "length")
                else:
                    self._advance(job, t, score)

    def forward(self, plan: Plan) -> torch.Tensor:
        """Run a plan's forwards -> the logits [prefills + decodes, V] (every rank runs this)."""
        if self.own_cache:
            return self._forward_each(plan)
        out, self._full = [], {}
        for slot, prompt in plan.prefill:
            positions = self.cache.bind([slot], [0], len(prompt))
            tokens = torch.tensor([prompt], dtype=torch.long, device=self.device)
            full = slot in plan.full
            logits = self.model(tokens, positions=positions, cache=self.cache, **({} if full else self._last_only))
            if full:
                self._full[slot] = logits[0]
            out.append(logits[:, -1])
        if plan.rows:
            positions = self.cache.bind(plan.rows, plan.starts, 1)
            tokens = torch.tensor(plan.tokens, dtype=torch.long, device=self.device)[:, None]
            out.append(self.model(tokens, positions=positions, cache=self.cache)[:, -1])
        return torch.cat(out).float() if out else torch.empty(0)

    def reserve(self) -> int:
        """Allocate the KV cache now (a one-token prefill into slot 0; every rank at once under TP):
        a cache that does not fit fails at start, not at the first request. -> its bytes."""
        try:
            self.forward(Plan(prefill=[(0, [max(self.tok.eos_id, 0)])]))
        except RuntimeError as e:  # torch.OutOfMemoryError on CUDA; the CPU allocator's "can't allocate"
            if not isinstance(e, torch.OutOfMemoryError) and "allocate" not in str(e):
                raise
            raise ConfigError(f"--max-seqs {self.max_seqs} x --max-model-len {self.max_len}: the KV cache does not fit "
                              f"({str(e).splitlines()[0]}); lower either") from None
        bufs = [b for layer in self.cache.layers.values() for b in (layer.k, layer.v) if b is not None]
        return sum(b.numel() * b.element_size() for b in bufs)

    def _forward_each(self, plan: Plan) -> torch.Tensor:
        """A model that keeps its own cache (transformers' attention, for `hf` models) cannot read the
        slots: each sequence runs alone over a cache of its own (models.kv_cache with one row), the
        same forwards torchmeg.generate runs for it. Sequences still join and leave at every step;
        only the decode forwards are not batched."""
        out, self._full = [], {}
        for slot, prompt in plan.prefill:
            cache = self.own[slot] = KVCache(1, self.max_len, device=self.device)
            tokens = torch.tensor([prompt], dtype=torch.long, device=self.device)
            full = slot in plan.full
            logits = self.model(tokens, positions=cache.positions(len(prompt)), cache=cache,
                                **({} if full else self._last_only))
            if full:
                self._full[slot] = logits[0]
            out.append(logits[:, -1])
            cache.advance(len(prompt))
        for slot, token in zip(plan.rows, plan.tokens):
            cache = self.own[slot]
            tokens = torch.tensor([[token]], dtype=torch.long, device=self.device)
            out.append(self.model(tokens, positions=cache.positions(1), cache=cache)[:, -1])
            cache.advance(1)
        return torch.cat(out).float() if out else torch.empty(0)

    def _sample(self, logits: torch.Tensor, jobs: list[Job]) -> list[int]:
        """Each row by its own request's sampling (its penalties first); rows that share it in one call.
        One host read."""
        nxt = torch.empty(len(jobs), dtype=torch.long, device=logits.device)
        penalized = [i for i, j in enumerate(jobs) if (j.presence or j.frequency) and j.tokens]
        if penalized:
            logits = logits.clone()
            for i in penalized:
                j, ids = jobs[i], torch.tensor(jobs[i].tokens, device=logits.device)
                counts = torch.zeros(logits.shape[-1], device=logits.device).index_add_(
                    0, ids, torch.ones(len(j.tokens), device=logits.device))
                logits[i] -= j.frequency * counts + j.presence * (counts > 0).float()
        groups: dict[Sampling, list[int]] = {}
        for i, job in enumerate(jobs):
            groups.setdefault(job.sampling, []).append(i)
        for s, idx in groups.items():
            rows = torch.tensor(idx, device=logits.device)
            streams = torch.tensor([jobs[i].stream for i in idx], dtype=torch.long)
            steps = torch.tensor([len(jobs[i].tokens) for i in idx], dtype=torch.long)
            nxt[rows] = sample(logits[rows], s, streams, steps)
        return nxt.tolist()

    def _logprobs(self, logits: torch.Tensor, jobs: list[Job], new: list[int]) -> list:
        """Per row, (the sampled token's log-probability, the top k (token, log-probability) pairs) for
        the jobs that asked (None for the others): the raw logits' log-softmax, one host read."""
        want = [i for i, j in enumerate(jobs) if j.logprobs >= 0]
        out = [None] * len(jobs)
        if want:
            rows = torch.tensor(want, device=logits.device)
            chosen = torch.tensor([new[i] for i in want], device=logits.device)
            for i, entry in zip(want, _scores(logits[rows], chosen, max(jobs[i].logprobs for i in want))):
                out[i] = (entry[0], entry[1][:jobs[i].logprobs])
        return out

    def _prompt_logprobs(self, job: Job) -> list:
        """The prompt's tokens after the first: each one's log-probability given those before it."""
        logits = self._full[job.slot].float()
        target = torch.tensor(job.prompt[1:], device=logits.device)
        return [(lp, top[:job.logprobs]) for lp, top in _scores(logits[:-1], target, job.logprobs)]

    def _advance(self, job: Job, token: int, score=None) -> None:
        if token in job.eos_ids:
            return self._finish(job, "stop")
        if score is not None:
            job.token_logprobs.append(score)  # (before on_event: the API reads it for this token)
        job.tokens.append(token)
        self.counters["generation_tokens"] += 1
        text = self.tok.decode(job.tokens)
        for s in job.stop:
            at = text.find(s)
            if at >= 0:
                return self._finish(job, "stop", text[:at], [token])
        if len(job.tokens) >= job.max_tokens:
            return self._finish(job, "length", text, [token])
        # Hold back what may still change: an incomplete UTF-8 character, the start of a stop string.
        safe = len(text.rstrip("\ufffd"))
        for s in job.stop:
            for k in range(min(len(s) - 1, safe), 0, -1):
                if text[:safe].endswith(s[:k]):
                    safe -= k
                    break
        if safe > job.sent:
            job.on_event(text[job.sent:safe], [token], None)
            job.sent = safe
        else:
            job.on_event("", [token], None)

    def _finish(self, job: Job, reason: str, text: str | None = None, ids: list[int] = ()) -> None:
        if job.finish_reason is not None:
            return
        job.finish_reason = reason
        text = self.tok.decode(job.tokens) if text is None else text
        job.on_event(text[job.sent:], list(ids), reason)
        job.sent = len(text)
        self._free(job)

    def _free(self, job: Job) -> None:
        if self.running.get(job.slot) is job:
            del self.running[job.slot]
            heapq.heappush(self.free, job.slot)


def _scores(logits_NV: torch.Tensor, chosen_N: torch.Tensor, k: int) -> list:
    """[(log p(chosen), [(token, log p)] of the k most likely, best first)] per row."""
    lp = logits_NV.float().log_softmax(-1)
    top = lp.topk(min(k, lp.shape[-1]), dim=-1) if k else None
    picked = lp.gather(-1, chosen_N[:, None])[:, 0].tolist()
    if top is None:
        return [(p, []) for p in picked]
    values, ids = top.values.tolist(), top.indices.tolist()
    return [(p, list(zip(i, v))) for p, i, v in zip(picked, ids, values)]


def follow(engine: Engine, receive: Callable[[], Plan]) -> None:
    """A TP rank other than 0: run the forwards rank 0 plans until it says stop."""
    with torch.no_grad():
        while True:
            plan = receive()
            if plan.stop:
                return
            if plan.prefill or plan.rows:
                engine.forward(plan)
