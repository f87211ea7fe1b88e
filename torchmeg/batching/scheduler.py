"""Continuous batching's decisions: which sequences run in the next forward, and in which blocks of
the paged KV cache (batching.blocks) their keys go.

Every step (`Scheduler.schedule`), as vLLM's scheduler decides its own:

1. Cancelled and finished sequences leave; their blocks go back to the pool (a cancelled one,
   running or waiting, is handed back through `take_dropped` to be finished as "abort", so whoever
   waits on it hears its end). The full blocks the last step wrote are keyed (prefix caching).
2. The running sequences, oldest first, each get the blocks for what they run now: one decode token,
   or the next chunk of a prompt under the step's budget of `prefill_tokens` (chunked prefill: a
   4,000-token prompt does not stall the running sequences for more than a step's budget). When the
   pool has no free block, the newest running sequence is **preempted** (its blocks given back, its
   tokens kept) and waits at the front of the queue; admitted again, it prefills its prompt and the
   tokens it had generated (recompute, vLLM's default) and goes on: never failed, and its tokens the
   ones it gets alone.
3. Waiting sequences are admitted while the budget, `max_seqs` and the free blocks allow (a
   watermark of blocks kept free, so an admission does not preempt at the next step what it
   admitted).

**Prefix caching.** A new prompt maps the cached blocks that hold its first tokens (a chat system
prompt, GRPO's `num_generations` completions of one prompt, a conversation's next turn, a finished
request's prompt) and computes only the rest: nothing is copied. A prompt whose prefix is being
computed in this very step waits a step for it, so a burst of requests with one system prompt
computes it once. Not for prompts whose every position is scored (echo: their logits are needed),
nor models that keep their own cache.

The plan is all the model runner (batching.runner) needs; under tensor parallel it is what rank 0
broadcasts, block tables included, so every rank's pool holds the same positions in the same blocks.
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import Callable

from torchmeg.batching.blocks import BlockPool
from torchmeg.batching.generation import Sampling, row_streams

WATERMARK = 0.01  # of the pool's blocks left free by an admission (vLLM's watermark)


class QueueFull(Exception):
    pass


@dataclass(eq=False)
class Job:
    """One sequence to generate. `on_event(text, token_ids, finish_reason)` is called from the
    engine's thread with each step's new text (and the finish reason at the end: "stop" | "length",
    "abort" when it was cancelled, or "error: ..." when the step failed)."""
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
    penalty_counts: object = None  # (batching.sampler) their counts on the device, of the first
    penalty_counted: int = 0       # this-many generated tokens
    repetition: float = 1.0      # vLLM's repetition penalty over the prompt's and generated tokens (1: off)
    repetition_seen: object = None  # (batching.sampler) those tokens as a mask on the device, of the first
    repetition_counted: int = 0     # this-many generated tokens
    logprobs: int = -1           # >= 0: each token's log-probability and the top this-many (-1: none)
    prompt_logprobs: bool = False  # the prompt's tokens' too (echo), with the same top count
    processed_logprobs: bool = False  # log-probs of the logits / temperature (what is sampled from; RL rollouts)
    # the engine's
    key: int = -1            # its number between the API process and the engine (serving.frontend)
    slot: int = -1           # its number in the running batch (the plan names sequences by it)
    prefilled: int = 0       # tokens of its context in the cache
    recompute: int = 0       # generated tokens its context holds (preempted: prefilled again with the prompt)
    blocks: list = field(default_factory=list)  # its block table (batching.blocks)
    keys: list = field(default_factory=list)    # the keys of its blocks keyed so far
    admitted: bool = False   # admitted before (a preempted one keeps its stream and counts)
    tokens: list[int] = field(default_factory=list)
    text: str = ""           # their text so far (batching.output) and how much of it was sent
    sent: int = 0
    stream: int = 0          # its random stream (batching.generation.row_streams)
    finish_reason: str | None = None
    cached_prompt: int = 0   # prompt tokens found in cached blocks, not computed (prefix caching)
    # per generated token, and the end-of-text token that ended it: (logprob, [(token, logprob)...])
    token_logprobs: list = field(default_factory=list)
    prompt_token_logprobs: list = field(default_factory=list)  # per prompt token after the first, alike
    arrived: float = 0.0     # monotonic seconds: submitted, last token (the metrics' latencies)
    last: float = 0.0
    detok: object = None     # batching.output's incremental detokenizer
    stop_token: tuple | None = None  # (the end-of-sequence token that ended it, its score when log-probs are asked)

    @property
    def context(self) -> list[int]:
        """What its prefill computes: the prompt, and after a preemption the tokens it had generated."""
        return self.prompt + self.tokens[:self.recompute] if self.recompute else self.prompt

    @property
    def final(self) -> int:
        """The positions its keys reach at most (its prompt, and every token but the last)."""
        return len(self.prompt) + max(self.max_tokens - 1, 0)

    @property
    def prefilling(self) -> bool:
        return self.prefilled < len(self.prompt) + self.recompute

    @property
    def cached(self) -> int:
        """Positions whose keys its blocks hold (the newest token is written by the next decode)."""
        if self.prefilling:
            return self.prefilled
        return len(self.prompt) + max(len(self.tokens) - 1, 0)


@dataclass
class Plan:
    """One step's forwards, naming sequences by their slot: `prefill`: (slot, start, tokens) chunks;
    `full`: the slots whose chunk keeps every position's logits (prompt log-probs); then one decode
    token per slot in `rows` (`tokens`, at `starts`); `tables`: the block table of every slot the step
    runs. `hits` / `queries`: prompt tokens found in cached blocks / looked up, this step."""
    prefill: list[tuple[int, int, list[int]]] = field(default_factory=list)
    full: list[int] = field(default_factory=list)
    rows: list[int] = field(default_factory=list)
    tokens: list[int] = field(default_factory=list)
    starts: list[int] = field(default_factory=list)
    tables: dict[int, list[int]] = field(default_factory=dict)
    hits: int = 0
    queries: int = 0
    stop: bool = False

    def runs(self) -> bool:
        return bool(self.prefill or self.rows)


class Scheduler:
    def __init__(self, max_seqs: int, max_queue: int, prefill_tokens: int, pool: BlockPool,
                 prefix_caching: bool = True):
        self.max_seqs, self.max_queue, self.prefill_tokens = max_seqs, max_queue, prefill_tokens
        self.pool, self.prefix_caching = pool, prefix_caching
        self.running: dict[int, Job] = {}   # slot -> job (prefilling or decoding), oldest admitted first
        self.waiting: deque[Job] = deque()
        self.dropped: list[Job] = []        # cancelled jobs taken out, not yet told (Engine.step: "abort")
        self.preemptions = 0
        self.watermark = int(WATERMARK * pool.usable)

    def take_dropped(self) -> list[Job]:
        out, self.dropped = self.dropped, []
        return out

    def add(self, job: Job) -> None:
        if len(self.waiting) >= self.max_queue:
            raise QueueFull(f"{len(self.running)} sequences running and {len(self.waiting)} waiting "
                            f"(--max-queue {self.max_queue}); retry later")
        self.waiting.append(job)

    def busy(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> tuple[Plan, list[Job], list[Job]]:
        """-> (the plan, the jobs of its prefill chunks in order, the decoding jobs in row order)."""
        for slot, job in list(self.running.items()):
            if job.cancelled or job.finish_reason is not None:
                del self.running[slot]
                if job.finish_reason is None:
                    self.dropped.append(job)
                # (a failed step may have half written its last blocks: never keyed, as they are not full)
                if not (job.finish_reason or "").startswith("error"):
                    self._key(job)
                self.pool.release(job.blocks)
        if any(j.cancelled for j in self.waiting):  # (they held a queue place until now)
            self.dropped += [j for j in self.waiting if j.cancelled]
            self.waiting = deque(j for j in self.waiting if not j.cancelled)
        for job in self.running.values():
            self._key(job)
        plan, budget, chunks, decoding = Plan(), self.prefill_tokens, [], []
        order = list(self.running.values())
        i = 0
        while i < len(order):  # the running ones, oldest first, each its blocks for this step
            job = order[i]
            n = min(len(job.prompt) + job.recompute - job.prefilled, budget) if job.prefilling else 0
            if job.prefilling and n <= 0:
                i += 1
                continue
            while not self.pool.grow(job.blocks, job.prefilled + n if n else job.cached + 1, job.final):
                victim = order.pop()  # the newest admitted (the job itself when it is the newest)
                self._preempt(victim)
                if victim is job:
                    break
            else:
                if n:
                    budget -= self._chunk(plan, job, n)
                    chunks.append(job)
                else:
                    decoding.append(job)
                i += 1
        later = []
        while self.waiting and budget > 0 and len(self.running) < self.max_seqs:
            job = self.waiting[0]
            hit = self._hit(job)
            reuse = len(hit) * self.pool.block_size
            if self.prefix_caching and not job.prompt_logprobs and self._computing(job, chunks) > reuse:
                later.append(self.waiting.popleft())  # a longer prefix of it is computed now: map it next step
                continue
            n = min(len(job.context) - reuse, budget)
            taken = sum(1 for b in hit if not self.pool.ref.get(b))  # (cached blocks in the free queue)
            new = self.pool.blocks_for(reuse + n) - len(hit)
            if new + taken > self.pool.free_count() - (self.watermark if self.running else 0):
                break  # until blocks come back
            self.waiting.popleft()
            job.slot = min(set(range(self.max_seqs)) - set(self.running))
            if not job.admitted:  # (first admission; a preempted one keeps its stream and counts)
                job.stream = int(row_streams([job.prompt], job.sample_index)[0])
                job.cached_prompt = reuse
                plan.queries += len(job.prompt)
                plan.hits += reuse
            job.admitted = True
            self.pool.share(job.blocks, hit)
            job.keys = [self.pool.key[b] for b in hit]
            self.pool.grow(job.blocks, reuse + n, job.final)
            job.prefilled = reuse
            self.running[job.slot] = job
            budget -= self._chunk(plan, job, n)
            chunks.append(job)
        self.waiting.extendleft(reversed(later))
        for job in decoding:
            plan.rows.append(job.slot)
            plan.tokens.append(job.tokens[-1])
            plan.starts.append(job.cached)
        plan.tables = {j.slot: list(j.blocks) for j in chunks + decoding}
        return plan, chunks, decoding

    def _hit(self, job: Job) -> list[int]:
        """The cached blocks job's context starts with (at least its last token left to compute: its
        logits give the next token)."""
        if not self.prefix_caching or job.prompt_logprobs:
            return []
        return self.pool.match(job.context, len(job.context) - 1)

    def _computing(self, job: Job, chunks: list[Job]) -> int:
        """The longest prefix of job's context, whole blocks, that this step's chunks compute."""
        best, B, ctx = 0, self.pool.block_size, job.context
        for c in chunks:
            other, n = c.context, 0
            top = min(len(ctx) - 1, c.prefilled) // B * B
            while n < top and ctx[n:n + B] == other[n:n + B]:
                n += B
            best = max(best, n)
        return best

    def _key(self, job: Job) -> None:
        """Key the full blocks job's written positions fill (prefix caching)."""
        if self.prefix_caching and job.cached // self.pool.block_size > len(job.keys):
            self.pool.register(job.blocks, job.keys, job.prompt + job.tokens, job.cached)

    def _preempt(self, job: Job) -> None:
        """Out of the running batch, its blocks given back (its full ones keyed: its recompute may find
        them), to the front of the queue; admitted again it prefills its prompt and its tokens."""
        del self.running[job.slot]
        self._key(job)
        self.pool.release(job.blocks)
        job.keys, job.prefilled, job.recompute = [], 0, len(job.tokens)
        if not job.tokens:  # (its prompt's scores are computed again)
            job.prompt_token_logprobs = []
        self.waiting.appendleft(job)
        self.preemptions += 1

    def _chunk(self, plan: Plan, job: Job, n: int) -> int:
        plan.prefill.append((job.slot, job.prefilled, job.context[job.prefilled:job.prefilled + n]))
        if job.prompt_logprobs and not job.tokens:
            plan.full.append(job.slot)
        job.prefilled += n
        return n
