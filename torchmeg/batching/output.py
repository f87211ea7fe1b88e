"""The output processor: each new token to text (incrementally), stop strings, end of sequence,
the request's stream. Runs on the engine's thread outside the lock the API's threads take.

Incremental detokenization as vLLM's and transformers' streaming detokenizers do it: decode only
the tokens since a stable offset, with a few tokens before it as context (a tokenizer that drops a
word's leading space at the start of a text keeps it here, as the prompt's continuation), and give
out the new text once it no longer ends in an incomplete character. A token costs a decode of a
handful of tokens, not of the whole completion.
"""
from __future__ import annotations

import time

from torchmeg.batching.scheduler import Job

CONTEXT = 5  # prompt tokens decoded before the first new one (vLLM's INITIAL_INCREMENTAL_DETOKENIZATION_OFFSET)


class Detokenizer:
    def __init__(self, tokenizer, prompt: list[int]):
        self.tok, self.ids = tokenizer, list(prompt[-CONTEXT:])
        self.prefix, self.read = 0, len(self.ids)

    def add(self, token: int) -> str:
        """The text `token` completes (empty while a character is incomplete)."""
        self.ids.append(token)
        before = self.tok.decode(self.ids[self.prefix:self.read])
        now = self.tok.decode(self.ids[self.prefix:])
        if len(now) > len(before) and not now.endswith("\ufffd"):
            self.prefix, self.read = self.read, len(self.ids)
            return now[len(before):]
        return ""

    def flush(self) -> str:
        """At the end: what is held back, incomplete or not."""
        before = self.tok.decode(self.ids[self.prefix:self.read])
        now = self.tok.decode(self.ids[self.prefix:])
        self.prefix = self.read = len(self.ids)
        return now[len(before):]


class OutputProcessor:
    def __init__(self, tokenizer, metrics=None):
        self.tok, self.metrics = tokenizer, metrics

    def advance(self, job: Job, token: int, score=None) -> None:
        """A job's new token: its text, a stop, its end; `job.on_event` with what can be sent."""
        now = time.monotonic()
        if self.metrics is not None:
            self.metrics.token(job, now)
        if token in job.eos_ids:
            # As vLLM gives it: the end-of-text token is in the ids, the log-probs and the token count,
            # not in the text (an evaluator reading token_logprobs[ctxlen:-1] drops the last one it gets).
            # `job.tokens` keeps the text's tokens; `stop_token` holds this one (RL rollouts append it).
            job.stop_token = (token, score)
            if score is not None:
                job.token_logprobs.append(score)
            if self.metrics is not None:
                self.metrics.generation_tokens.inc()
            return self.finish(job, "stop", ids=[token])
        if score is not None:
            job.token_logprobs.append(score)  # (before on_event: the API reads it for this token)
        job.tokens.append(token)
        if self.metrics is not None:
            self.metrics.generation_tokens.inc()
        if job.detok is None:
            job.detok, job.text, job.sent = Detokenizer(self.tok, job.prompt), "", 0
        old = len(job.text)
        job.text += job.detok.add(token)
        for s in job.stop:
            at = job.text.find(s, max(0, old - len(s) + 1))
            if at >= 0:
                return self.finish(job, "stop", at, [token])
        if len(job.tokens) >= job.max_tokens:
            return self.finish(job, "length", ids=[token])
        safe = len(job.text)  # hold back the start of a stop string: the next token may complete it
        for s in job.stop:
            for k in range(min(len(s) - 1, safe), 0, -1):
                if job.text.endswith(s[:k]):
                    safe = min(safe, len(job.text) - k)
                    break
        if safe > job.sent:
            job.on_event(job.text[job.sent:safe], [token], None)
            job.sent = safe
        else:
            job.on_event("", [token], None)

    def finish(self, job: Job, reason: str, cut: int | None = None, ids: list[int] = ()) -> None:
        if job.finish_reason is not None:
            return
        job.finish_reason = reason
        if job.detok is None:
            job.text, job.sent = "", 0
        elif cut is None and not reason.startswith("error"):
            job.text += job.detok.flush()
        text = job.text if cut is None else job.text[:cut]
        if self.metrics is not None:
            self.metrics.finished(job, reason)
        job.on_event(text[job.sent:], list(ids), reason)
        job.sent = len(text)
