"""The HTTP side: OpenAI's /v1/completions, /v1/chat/completions (streamed as server-sent events
or not), /v1/models, /health and /metrics, on FastAPI. Requests become scheduler Jobs; the engine's
thread hands each step's text back to the request's event loop.
"""
from __future__ import annotations

import asyncio
import json
import secrets
import time
import uuid
from dataclasses import dataclass, field

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException

from torchmeg.batching.generation import Sampling
from torchmeg.serving.protocol import ChatRequest, CompletionRequest, DetokenizeRequest, TokenizeRequest, error_body
from torchmeg.batching.scheduler import Job, QueueFull

_DISCONNECT_POLL_S = 0.5   # with no token for this long, ask whether the client is still there
_DISCONNECT_EVERY_S = 0.1  # and at least this often while tokens come


@dataclass
class Served:
    """What the routes need: the engine (its client in this process: serving.frontend, which calls
    each job's on_event on this event loop), the tokenizer, the chat template (None: no chat), the
    model's id and context length."""
    engine: object
    tokenizer: object
    template: object | None
    template_error: str
    model_id: str
    max_len: int
    defaults: dict = field(default_factory=dict)  # sampling defaults (inference.sampling_defaults)


class ApiError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None, kind: str = "invalid_request_error",
                 code: str | None = None):
        super().__init__(message)
        self.status, self.body = status, error_body(message, kind, param, code)


def build_app(s: Served, lifespan=None) -> FastAPI:
    app = FastAPI(title="torchmeg", lifespan=lifespan)

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, exc: RequestValidationError):
        e = exc.errors()[0]
        where = ".".join(str(x) for x in e.get("loc", ()) if x != "body")
        if e.get("type") == "json_invalid":
            return JSONResponse(error_body(f"the body is not valid JSON: {e.get('msg')}"), status_code=400)
        return JSONResponse(error_body(f"{where or 'body'}: {e.get('msg')}", param=where or None), status_code=400)

    @app.exception_handler(HTTPException)
    async def _http(request: Request, exc: HTTPException):
        # FastAPI's own 4xx (a body it cannot decode, e.g. not UTF-8; an unknown route or method), in
        # the API's error shape rather than {"detail": ...}
        message = exc.detail if isinstance(exc.detail, str) else json.dumps(exc.detail)
        if exc.status_code == 400 and "parsing the body" in message:
            message = "the body is not valid JSON in UTF-8 (" + message + ")"
        kind = "invalid_request_error" if exc.status_code < 500 else "server_error"
        return JSONResponse(error_body(message, kind), status_code=exc.status_code, headers=exc.headers)

    @app.exception_handler(ApiError)
    async def _api_error(request: Request, exc: ApiError):
        return JSONResponse(exc.body, status_code=exc.status)

    @app.get("/health")
    async def health():
        return {"status": "ok"}

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": s.model_id, "object": "model", "created": 0, "owned_by": "torchmeg",
                                            "max_model_len": s.max_len}]}

    @app.get("/metrics")
    async def metrics():
        s.engine.load()  # (the gauges, read now)
        return Response(s.engine.metrics.render(), media_type="text/plain; version=0.0.4; charset=utf-8")

    @app.post("/tokenize")
    async def tokenize(body: TokenizeRequest):
        ids = (s.tokenizer.encode_with_specials if body.add_special_tokens else s.tokenizer.encode)(body.prompt)
        return {"tokens": ids, "count": len(ids), "max_model_len": s.max_len}

    @app.post("/detokenize")
    async def detokenize(body: DetokenizeRequest):
        vocab = s.tokenizer.vocab_size
        if not all(0 <= t < vocab for t in body.tokens):
            raise ApiError(400, f"tokens: ids must be in [0, {vocab})", "tokens")
        return {"prompt": s.tokenizer.decode(body.tokens)}

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request):
        _check(s, body)
        prompts = body.prompt if isinstance(body.prompt, list) and body.prompt and not isinstance(body.prompt[0], int) \
            else [body.prompt]
        ids = [_ids(s, p) for p in prompts]
        texts = [p if isinstance(p, str) else s.tokenizer.decode(p) for p in prompts]
        max_tokens = 16 if body.max_tokens is None else body.max_tokens
        for i in ids:
            _fits(s, len(i), max_tokens, allow_zero=body.echo)
        eos = frozenset() if body.ignore_eos else s.tokenizer.end_ids
        specs = [(p, i) for p in range(len(ids)) for i in range(body.n)]
        jobs = [_job(ids[p], max_tokens, body, i, body.stops(), eos, s.defaults) for p, i in specs]
        for job in jobs:
            job.logprobs = -1 if body.logprobs is None else body.logprobs
            job.prompt_logprobs = body.echo and body.logprobs is not None
        prefix = [texts[p] if body.echo else "" for p, _ in specs]
        usage_prompt = sum(len(i) for i in ids)
        return await _respond(s, request, body, jobs, "cmpl", prefix, usage_prompt, chat=False)

    @app.post("/v1/chat/completions")
    async def chat(body: ChatRequest, request: Request):
        _check(s, body)
        if s.template is None:
            raise ApiError(400, f"this model has no chat template: {s.template_error}", "messages")
        text = s.template.render([{"role": m.role, "content": m.text()} for m in body.messages],
                                 add_generation_prompt=True)
        ids = s.tokenizer.encode(text) or [s.tokenizer.eos_id]
        max_tokens = body.max_completion_tokens or body.max_tokens or \
            min(max(s.max_len - len(ids), 0), s.defaults.get("max_tokens", s.max_len))  # (vLLM's cap)
        _fits(s, len(ids), max_tokens)
        end, end_id = s.template.end_of_turn(s.tokenizer)
        eos = set() if body.ignore_eos else set(s.tokenizer.end_ids)
        if end_id is not None and not body.ignore_eos:
            eos.add(end_id)  # the end of the turn is one token (HF templates): stop there
        stops = body.stops() + ((end,) if end and not body.ignore_eos else ())
        jobs = [_job(ids, max_tokens, body, i, stops, frozenset(eos), s.defaults) for i in range(body.n)]
        for job in jobs:
            job.logprobs = (body.top_logprobs or 0) if body.logprobs else -1
        return await _respond(s, request, body, jobs, "chatcmpl", [""] * body.n, len(ids), chat=True)

    return app


def _check(s: Served, body) -> None:
    if body.model != s.model_id:
        raise ApiError(404, f"The model `{body.model}` does not exist; this server serves `{s.model_id}` "
                            f"(GET /v1/models)", "model", code="model_not_found")
    bad = body.unsupported()
    if bad:
        raise ApiError(400, bad[1], bad[0])


def _ids(s: Served, prompt) -> list[int]:
    if isinstance(prompt, str):
        # As vLLM's completions: the tokenizer's own special tokens added (a Llama-3 BOS); an empty
        # prompt (no such token) starts a new document.
        return s.tokenizer.encode_with_specials(prompt) or [s.tokenizer.eos_id]
    vocab = s.tokenizer.vocab_size
    if not prompt or not all(0 <= t < vocab for t in prompt):
        raise ApiError(400, f"prompt: token ids must be a non-empty list of ids in [0, {vocab})", "prompt")
    return list(prompt)


def _fits(s: Served, prompt: int, max_tokens: int, allow_zero: bool = False) -> None:
    if prompt >= s.max_len + allow_zero:
        raise ApiError(400, f"This model's maximum context length is {s.max_len} tokens. However, your prompt has "
                            f"{prompt} tokens, which leaves no room for a completion. Please reduce the prompt.",
                       "messages", code="context_length_exceeded")
    if max_tokens < (0 if allow_zero else 1) or prompt + max_tokens > s.max_len:
        raise ApiError(400, f"This model's maximum context length is {s.max_len} tokens. However, you requested "
                            f"{prompt + max_tokens} tokens ({prompt} in the prompt, {max_tokens} for the completion). "
                            f"Please reduce the prompt or max_tokens.", "max_tokens", code="context_length_exceeded")


def _job(ids, max_tokens, body, index: int, stops, eos, defaults: dict) -> Job:
    # an unseeded request draws its own seed: identical requests at a temperature differ, as with any
    # sampler; a seeded one is a function of (prompt, sampling, seed), the seed 0 included
    seed = body.seed if body.seed is not None else secrets.randbits(62)
    given = lambda key, api: getattr(body, key) if getattr(body, key) is not None else defaults.get(key, api)  # noqa: E731
    sampling = Sampling(given("temperature", 1.0), given("top_k", 0), given("top_p", 1.0), seed, given("min_p", 0.0))
    return Job(list(ids), max_tokens, sampling, on_event=None, stop=stops, eos_ids=eos, sample_index=index,
               presence=body.presence_penalty, frequency=body.frequency_penalty,
               repetition=given("repetition_penalty", 1.0))


async def _respond(s: Served, request: Request, body, jobs: list[Job], kind: str, prefix: list[str],
                   prompt_tokens: int, chat: bool):
    events = asyncio.Queue()
    for i, job in enumerate(jobs):
        job.on_event = lambda text, ids, reason, i=i: events.put_nowait((i, text, reason))
    try:
        s.engine.submit_all(jobs)  # (all n of a request, or none)
    except QueueFull as e:
        for job in jobs:
            s.engine.cancel(job)
        raise ApiError(429, f"the server is busy: {e}", kind="rate_limit_error", code="queue_full") from None
    rid, created = f"{kind}-{uuid.uuid4().hex[:24]}", int(time.time())
    if body.stream:
        return StreamingResponse(_stream(s, request, body, jobs, events, rid, created, prefix, prompt_tokens, chat),
                                 media_type="text/event-stream")
    texts, reasons = list(prefix), [None] * len(jobs)
    checked = time.monotonic()
    try:
        while None in reasons:
            try:
                i, text, reason = events.get_nowait() if not events.empty() else \
                    await asyncio.wait_for(events.get(), _DISCONNECT_POLL_S)
                texts[i] += text
                reasons[i] = reason
            except asyncio.TimeoutError:
                pass
            if time.monotonic() - checked >= _DISCONNECT_EVERY_S and None in reasons:
                # (tokens come every step: a client that left is noticed between them, not only in a lull)
                checked = time.monotonic()
                if await request.is_disconnected():
                    return JSONResponse(error_body("client disconnected"), status_code=499)
    finally:
        for job in jobs:  # a disconnected (or failed) request frees its slots
            if job.finish_reason is None:
                s.engine.cancel(job)
    failed = [r for r in reasons if r.startswith("error")]
    if failed:
        raise ApiError(500, f"generation failed: {failed[0][7:]}", kind="server_error")
    usage = _usage(prompt_tokens, jobs)
    if chat:
        choices = [{"index": i, "message": {"role": "assistant", "content": t}, "finish_reason": r,
                    "logprobs": _chat_logprobs(s, j, j.tokens, j.token_logprobs)}
                   for i, (t, r, j) in enumerate(zip(texts, reasons, jobs))]
        return {"id": rid, "object": "chat.completion", "created": created, "model": s.model_id, "choices": choices,
                "usage": usage}
    choices = [{"index": i, "text": t, "logprobs": _completion_logprobs(s, j, echo=True),
                "finish_reason": r} for i, (t, r, j) in enumerate(zip(texts, reasons, jobs))]
    return {"id": rid, "object": "text_completion", "created": created, "model": s.model_id, "choices": choices,
            "usage": usage}


async def _stream(s: Served, request: Request, body, jobs, events, rid, created, prefix, prompt_tokens, chat):
    obj = "chat.completion.chunk" if chat else "text_completion"

    done = [0] * len(jobs)  # tokens whose log-probs were sent, per job
    echoed = [False] * len(jobs)  # the prompt's log-probs (echo) go with the job's first event

    def chunk(i, text, reason, first=False):
        job, lp = jobs[i], None
        if job.logprobs >= 0 and not first:
            n = min(len(job.tokens), len(job.token_logprobs))  # (the engine's thread may be appending)
            ids, scores = job.tokens[done[i]:n], job.token_logprobs[done[i]:n]
            echo, echoed[i] = job.prompt_logprobs and not echoed[i], True
            done[i] = n
            lp = _chat_logprobs(s, job, ids, scores) if chat else _completion_logprobs(s, job, echo, ids, scores)
        if chat:
            delta = {"role": "assistant", "content": text} if first else ({"content": text} if text else {})
            choice = {"index": i, "delta": delta, "finish_reason": reason, "logprobs": lp}
        else:
            choice = {"index": i, "text": text, "finish_reason": reason, "logprobs": lp}
        return _sse({"id": rid, "object": obj, "created": created, "model": s.model_id, "choices": [choice]})

    left = len(jobs)
    try:
        for i in range(len(jobs)):
            if chat or prefix[i]:
                yield chunk(i, prefix[i], None, first=True)
        while left:
            try:  # (a timer only when the queue is empty)
                batch = [events.get_nowait() if not events.empty() else
                         await asyncio.wait_for(events.get(), _DISCONNECT_POLL_S)]
            except asyncio.TimeoutError:
                if await request.is_disconnected():
                    return
                continue
            while not events.empty():  # every event already there in one write (a loop that fell behind)
                batch.append(events.get_nowait())
            out = []
            for i, text, reason in batch:
                if reason and reason.startswith("error"):
                    yield "".join(out) + _sse(error_body(f"generation failed: {reason[7:]}", "server_error"))
                    return
                if text or reason:
                    out.append(chunk(i, text, reason))
                left -= reason is not None
            if out:
                yield "".join(out)
        if body.stream_options and body.stream_options.include_usage:
            yield _sse({"id": rid, "object": obj, "created": created, "model": s.model_id, "choices": [],
                        "usage": _usage(prompt_tokens, jobs)})
        yield "data: [DONE]\n\n"
    finally:  # the client went away (the response is cancelled) or the stream ended: free the slots
        for job in jobs:
            if job.finish_reason is None:
                s.engine.cancel(job)


def _piece(s: Served, token: int) -> str:
    return s.tokenizer.decode([token])


def _completion_logprobs(s: Served, job: Job, echo: bool, ids=None, scores=None) -> dict | None:
    """/v1/completions' logprobs object: tokens, token_logprobs, top_logprobs, text_offset; with `echo`
    the prompt's first where the job scored it (its first token without a log-prob)."""
    if job.logprobs < 0:
        return None
    ids = job.tokens if ids is None else ids
    scores = job.token_logprobs if scores is None else scores
    tokens, values, tops = [], [], []
    if echo and job.prompt_logprobs:
        tokens, values, tops = [job.prompt[0]], [None], [None]
        for t, (lp, top) in zip(job.prompt[1:], job.prompt_token_logprobs):
            tokens.append(t), values.append(lp), tops.append(top)
    for t, (lp, top) in zip(ids, scores):
        tokens.append(t), values.append(lp), tops.append(top)
    pieces = [_piece(s, t) for t in tokens]
    offsets, at = [], 0
    for p in pieces:
        offsets.append(at)
        at += len(p)
    return {"tokens": pieces, "token_logprobs": values, "text_offset": offsets,
            "top_logprobs": [None if top is None else {_piece(s, t): v for t, v in top} for top in tops]}


def _chat_logprobs(s: Served, job: Job, ids, scores) -> dict | None:
    """Chat's logprobs object: {"content": [{token, logprob, bytes, top_logprobs}]}."""
    if job.logprobs < 0:
        return None

    def one(t, lp):
        piece = _piece(s, t)
        return {"token": piece, "logprob": lp, "bytes": list(piece.encode())}
    return {"content": [dict(one(t, lp), top_logprobs=[one(u, v) for u, v in top]) for t, (lp, top) in zip(ids, scores)]}


def _usage(prompt_tokens: int, jobs: list[Job]) -> dict:
    completion = sum(len(j.tokens) for j in jobs)
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion, "total_tokens": prompt_tokens + completion}


def _sse(obj) -> str:
    return f"data: {json.dumps(obj)}\n\n"
