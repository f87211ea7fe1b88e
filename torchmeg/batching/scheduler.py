"""Continuous batching's decisions: which sequences run in the next forward, in which slots.

Every step (`Scheduler.schedule`): cancelled and finished sequences leave (a cancelled one, running
or waiting, is handed back through `take_dropped` to be finished as "abort", so whoever waits on it
hears its end); the running sequences
are kept in slots 0..n-1 (the last one moves into a hole: one copy per departure, `Plan.moves`, so
the decode step reads the cache as a view); then prompt tokens are scheduled under a budget of
`prefill_tokens` per step: first the next chunk of prompts already being prefilled, then new
requests, each into the lowest free slot, a prompt longer than what is left of the budget taking a
chunk of it (chunked prefill: a 4,000-token prompt does not stall the running sequences for more
than a step's budget). Every running sequence whose prompt is in the cache decodes one token in
the same step.

**Prefix caching.** A new prompt whose first tokens are already in another running sequence's slot
(a chat system prompt, GRPO's `num_generations` completions of one prompt, few-shot examples) starts
from a copy of those keys and values (`Plan.copies`, in whole blocks of BLOCK tokens, as vLLM's
hashed blocks) and computes only the rest; a prompt that shares a prefix with one that is being
prefilled in this very step waits a step for it, so a burst of requests with one system prompt
computes it once. The copy is a read of the cache (one slot's positions, every layer), where
computing them is a forward over them: vLLM shares the pages themselves (a page table the attention
kernel reads; batching.slots says why the slots here are contiguous). Not for prompts whose every
position is scored (echo: their logits are needed), nor models that keep their own cache.

The plan is all the model runner (batching.runner) needs; under tensor parallel it is what rank 0
broadcasts. With one slot of max_len per sequence an admitted sequence always fits: there is no
preemption (a paged cache would admit more sequences than fit at their longest and preempt when
the pages run out; see batching.slots).
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import Callable

from torchmeg.batching.generation import Sampling, row_streams


BLOCK = 16  # prefix reuse in whole blocks of this many tokens (vLLM's default block size)


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
    slot: int = -1
    prefilled: int = 0       # prompt tokens in the cache
    tokens: list[int] = field(default_factory=list)
    text: str = ""           # their text so far (batching.output) and how much of it was sent
    sent: int = 0
    stream: int = 0          # its random stream (batching.generation.row_streams)
    finish_reason: str | None = None
    cached_prompt: int = 0   # prompt tokens copied from another sequence's cache (prefix caching)
    # per generated token, and the end-of-text token that ended it: (logprob, [(token, logprob)...])
    token_logprobs: list = field(default_factory=list)
    prompt_token_logprobs: list = field(default_factory=list)  # per prompt token after the first, alike
    arrived: float = 0.0     # monotonic seconds: submitted, last token (the metrics' latencies)
    last: float = 0.0
    detok: object = None     # batching.output's incremental detokenizer
    stop_token: tuple | None = None  # (the end-of-sequence token that ended it, its score when log-probs are asked)

    @property
    def cached(self) -> int:
        """Positions of its slot that hold keys (the newest token is written by the next decode)."""
        return self.prefilled + max(len(self.tokens) - 1, 0)


@dataclass
class Plan:
    """One step's forwards. `moves`: (src, dst, length) slot copies first (a sequence moved); `copies`:
    (src, dst, length) then, a prompt's cached prefix copied into its slot; `prefill`: (slot, start,
    tokens) prompt chunks; `full`: the slots whose chunk keeps every position's logits (prompt
    log-probs); then one decode token per slot in `rows` (`tokens`, at `starts`; `riders`: rows of
    sequences still prefilling, whose logits are not read)."""
    moves: list[tuple[int, int, int]] = field(default_factory=list)
    copies: list[tuple[int, int, int]] = field(default_factory=list)
    prefill: list[tuple[int, int, list[int]]] = field(default_factory=list)
    full: list[int] = field(default_factory=list)
    rows: list[int] = field(default_factory=list)
    tokens: list[int] = field(default_factory=list)
    starts: list[int] = field(default_factory=list)
    riders: list[int] = field(default_factory=list)  # rows of sequences still being prefilled (filler tokens)
    stop: bool = False


def _content(job: Job) -> list[int]:
    """The tokens whose keys and values job's slot holds: its prompt so far, then what it generated
    (the newest token is written by the next decode)."""
    done = job.prompt[:job.prefilled]
    return done + job.tokens[:-1] if job.prefilled == len(job.prompt) and len(job.tokens) > 1 else done


class Scheduler:
    def __init__(self, max_seqs: int, max_queue: int, prefill_tokens: int, max_len: int, filler: int = 0,
                 prefix_caching: bool = True):
        self.max_seqs, self.max_queue, self.prefill_tokens = max_seqs, max_queue, prefill_tokens
        self.max_len, self.filler, self.prefix_caching = max_len, filler, prefix_caching
        self.running: dict[int, Job] = {}   # slot -> job (prefilling or decoding)
        self.waiting: deque[Job] = deque()
        self.free: dict[int, list[int]] = {}  # a free slot -> the tokens its cache still holds (prefix caching)
        self.dropped: list[Job] = []        # cancelled jobs taken out, not yet told (Engine.step: "abort")

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

    def schedule(self) -> tuple[Plan, list[Job], list[Job], list[int]]:
        """-> (the plan, the jobs of its prefill chunks in order, the decoding jobs, their rows)."""
        for slot, job in list(self.running.items()):
            if job.cancelled or job.finish_reason is not None:
                del self.running[slot]
                if job.finish_reason is None:
                    self.dropped.append(job)
                if self.prefix_caching and not (job.finish_reason or "").startswith("error"):
                    self.free[slot] = _content(job)  # (a failed step may have left its slot half written)
        if any(j.cancelled for j in self.waiting):  # (they held a queue place until now)
            self.dropped += [j for j in self.waiting if j.cancelled]
            self.waiting = deque(j for j in self.waiting if not j.cancelled)
        plan = Plan(moves=self._compact())
        # what each slot's cache holds as this step starts (running sequences', and what free slots
        # kept of a finished or moved one's): the prefixes a new prompt can copy
        held = ([(j.slot, _content(j)) for j in self.running.values() if j.prefilled] + list(self.free.items())
                if self.prefix_caching and self.waiting else [])
        budget, chunks, later = self.prefill_tokens, [], []
        for job in sorted(self.running.values(), key=lambda j: j.slot):  # prompts being prefilled go on
            if job.prefilled < len(job.prompt) and budget > 0:
                budget -= self._chunk(plan, job, budget)
                chunks.append(job)
        while self.waiting and budget > 0 and len(self.running) < self.max_seqs:
            job = self.waiting.popleft()
            src, reuse = self._prefix(job, held)
            if self._prefix(job, [(c.slot, c.prompt[:c.prefilled]) for c in chunks])[1] > reuse:
                later.append(job)  # a longer prefix of it is being computed now: copy it next step
                continue
            job.slot = len(self.running)  # (slots 0..n-1 are taken: the compaction above)
            job.stream = int(row_streams([job.prompt], job.sample_index)[0])
            self.running[job.slot] = job
            if reuse and src != job.slot:  # (its own slot may hold the prefix already: nothing to copy)
                plan.copies.append((src, job.slot, reuse))
            job.prefilled = job.cached_prompt = reuse
            if self.free.pop(job.slot, None) is not None:  # written from now on
                held = [(slot, toks) for slot, toks in held if slot != job.slot]
            budget -= self._chunk(plan, job, budget)
            chunks.append(job)
        self.waiting.extendleft(reversed(later))
        # One decode row per running slot, 0..n-1 (a view of the cache): a sequence still being
        # prefilled rides along with a filler token written where its next chunk (or its first
        # decode) writes over it, its logits not read.
        prefilling = {id(j) for j in chunks}
        decoding, rows = [], []
        for slot in range(len(self.running)):
            job = self.running[slot]
            if job.prefilled == len(job.prompt) and job.tokens and id(job) not in prefilling:
                decoding.append(len(rows))
                plan.tokens.append(job.tokens[-1])
                plan.starts.append(job.cached)
            else:
                plan.riders.append(len(rows))
                plan.tokens.append(self.filler)
                plan.starts.append(min(job.prefilled, self.max_len - 1))
            rows.append(job)
        plan.rows = list(range(len(rows))) if decoding else []
        if not decoding:
            plan.tokens, plan.starts, plan.riders = [], [], []
        return plan, chunks, [rows[i] for i in decoding], decoding

    def _prefix(self, job: Job, held: list[tuple[int, list[int]]]) -> tuple[int, int]:
        """(slot, length) of the longest prefix of job's prompt, in whole blocks, that a slot in `held`
        ((slot, the tokens its cache holds)) holds, its own slot first on a tie; at least the prompt's
        last token is left to compute (its logits give the first token). (-1, 0): none."""
        if not self.prefix_caching or job.prompt_logprobs:
            return -1, 0
        p, best, own = job.prompt, (-1, 0), len(self.running)
        limit = (len(p) - 1) // BLOCK * BLOCK
        for slot, other in held:
            n, top = 0, min(limit, len(other) // BLOCK * BLOCK)
            while n < top and p[n:n + BLOCK] == other[n:n + BLOCK]:
                n += BLOCK
            if n > best[1] or (n == best[1] and n and slot == own):
                best = (slot, n)
        return best

    def _chunk(self, plan: Plan, job: Job, budget: int) -> int:
        n = min(len(job.prompt) - job.prefilled, budget)
        plan.prefill.append((job.slot, job.prefilled, job.prompt[job.prefilled:job.prefilled + n]))
        if job.prompt_logprobs:
            plan.full.append(job.slot)
        job.prefilled += n
        return n

    def _compact(self) -> list[tuple[int, int, int]]:
        """Move the highest running slots into the holes below them -> the moves, in order."""
        moves, n = [], len(self.running)
        holes = [s for s in range(n) if s not in self.running]
        for dst, src in zip(holes, sorted((s for s in self.running if s >= n), reverse=True)):
            job = self.running.pop(src)
            moves.append((src, dst, job.cached))
            job.slot = dst
            self.running[dst] = job
            if self.prefix_caching:  # dst is written over; src keeps a copy of what moved
                self.free.pop(dst, None)
                self.free[src] = _content(job)
        return moves
