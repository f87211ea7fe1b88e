"""The HTTP side: OpenAI's /v1/completions, /v1/chat/completions (streamed as server-sent events
or not), /v1/models, /health and /metrics, on FastAPI. Requests become scheduler Jobs; the engine's
thread hands each step's text back to the request's event loop.
"""
from __future__ import annotations

import asyncio
import json
import time
import uuid
from dataclasses import dataclass

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse

from torchmeg.inference.engine import Sampling
from torchmeg.serving.protocol import ChatRequest, CompletionRequest, error_body
from torchmeg.serving.scheduler import Engine, Job, QueueFull

_DISCONNECT_POLL_S = 0.5


@dataclass
class Served:
    """What the routes need: the engine, the tokenizer, the chat template (None: no chat), the
    model's id and context length."""
    engine: Engine
    tokenizer: object
    template: object | None
    template_error: str
    model_id: str
    max_len: int


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
        lines = []
        for k, v in s.engine.load().items():
            kind = "gauge" if k in ("running", "waiting", "max_seqs") else "counter"
            name = f"torchmeg_{k}" + ("_total" if kind == "counter" else "")
            lines += [f"# TYPE {name} {kind}", f"{name} {v}"]
        return PlainTextResponse("\n".join(lines) + "\n")

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request):
        _check(s, body)
        prompts = body.prompt if isinstance(body.prompt, list) and body.prompt and not isinstance(body.prompt[0], int) \
            else [body.prompt]
        ids = [_ids(s, p) for p in prompts]
        texts = [p if isinstance(p, str) else s.tokenizer.decode(p) for p in prompts]
        max_tokens = body.max_tokens or 16
        for i in ids:
            _fits(s, len(i), max_tokens)
        eos = frozenset() if body.ignore_eos else frozenset({s.tokenizer.eos_id})
        specs = [(p, i) for p in range(len(ids)) for i in range(body.n)]
        jobs = [_job(ids[p], max_tokens, body, i, body.stops(), eos) for p, i in specs]
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
        max_tokens = body.max_completion_tokens or body.max_tokens or s.max_len - len(ids)
        _fits(s, len(ids), max_tokens)
        end = s.template.terminator()
        end_ids = s.tokenizer.encode(end) if end else []
        eos = set() if body.ignore_eos else {s.tokenizer.eos_id}
        if len(end_ids) == 1 and not body.ignore_eos:
            eos.add(end_ids[0])  # the end of the turn is one token (HF templates): stop there
        stops = body.stops() + ((end,) if end and not body.ignore_eos else ())
        jobs = [_job(ids, max_tokens, body, i, stops, frozenset(eos)) for i in range(body.n)]
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
        return s.tokenizer.encode(prompt) or [s.tokenizer.eos_id]  # an empty prompt starts a new document
    vocab = s.tokenizer.vocab_size
    if not prompt or not all(0 <= t < vocab for t in prompt):
        raise ApiError(400, f"prompt: token ids must be a non-empty list of ids in [0, {vocab})", "prompt")
    return list(prompt)


def _fits(s: Served, prompt: int, max_tokens: int) -> None:
    if max_tokens < 1 or prompt + max_tokens > s.max_len:
        raise ApiError(400, f"This model's maximum context length is {s.max_len} tokens. However, you requested "
                            f"{prompt + max_tokens} tokens ({prompt} in the prompt, {max_tokens} for the completion). "
                            f"Please reduce the prompt or max_tokens.", "max_tokens", code="context_length_exceeded")


def _job(ids, max_tokens, body, index: int, stops, eos) -> Job:
    sampling = Sampling(body.temperature, body.top_k, body.top_p, body.seed or 0)
    return Job(list(ids), max_tokens, sampling, on_event=None, stop=stops, eos_ids=eos, sample_index=index)


async def _respond(s: Served, request: Request, body, jobs: list[Job], kind: str, prefix: list[str],
                   prompt_tokens: int, chat: bool):
    loop, events = asyncio.get_running_loop(), asyncio.Queue()
    for i, job in enumerate(jobs):
        job.on_event = lambda text, ids, reason, i=i: loop.call_soon_threadsafe(events.put_nowait, (i, text, reason))
    try:
        for job in jobs:
            s.engine.submit(job)
    except QueueFull as e:
        for job in jobs:
            s.engine.cancel(job)
        raise ApiError(429, f"the server is busy: {e}", kind="rate_limit_error", code="queue_full") from None
    rid, created = f"{kind}-{uuid.uuid4().hex[:24]}", int(time.time())
    if body.stream:
        return StreamingResponse(_stream(s, request, body, jobs, events, rid, created, prefix, prompt_tokens, chat),
                                 media_type="text/event-stream")
    texts, reasons = list(prefix), [None] * len(jobs)
    try:
        while None in reasons:
            try:
                i, text, reason = await asyncio.wait_for(events.get(), _DISCONNECT_POLL_S)
            except asyncio.TimeoutError:
                if await request.is_disconnected():
                    return JSONResponse(error_body("client disconnected"), status_code=499)
                continue
            texts[i] += text
            reasons[i] = reason
    finally:
        for job in jobs:  # a disconnected (or failed) request frees its slots
            if job.finish_reason is None:
                s.engine.cancel(job)
    failed = [r for r in reasons if r.startswith("error")]
    if failed:
        raise ApiError(500, f"generation failed: {failed[0][7:]}", kind="server_error")
    usage = _usage(prompt_tokens, jobs)
    if chat:
        choices = [{"index": i, "message": {"role": "assistant", "content": t}, "finish_reason": r, "logprobs": None}
                   for i, (t, r) in enumerate(zip(texts, reasons))]
        return {"id": rid, "object": "chat.completion", "created": created, "model": s.model_id, "choices": choices,
                "usage": usage}
    choices = [{"index": i, "text": t, "logprobs": None, "finish_reason": r} for i, (t, r) in enumerate(zip(texts, reasons))]
    return {"id": rid, "object": "text_completion", "created": created, "model": s.model_id, "choices": choices,
            "usage": usage}


async def _stream(s: Served, request: Request, body, jobs, events, rid, created, prefix, prompt_tokens, chat):
    obj = "chat.completion.chunk" if chat else "text_completion"

    def chunk(i, text, reason, first=False):
        if chat:
            delta = {"role": "assistant", "content": text} if first else ({"content": text} if text else {})
            choice = {"index": i, "delta": delta, "finish_reason": reason, "logprobs": None}
        else:
            choice = {"index": i, "text": text, "finish_reason": reason, "logprobs": None}
        return _sse({"id": rid, "object": obj, "created": created, "model": s.model_id, "choices": [choice]})

    left = len(jobs)
    try:
        for i in range(len(jobs)):
            if chat or prefix[i]:
                yield chunk(i, prefix[i], None, first=True)
        while left:
            try:
                i, text, reason = await asyncio.wait_for(events.get(), _DISCONNECT_POLL_S)
            except asyncio.TimeoutError:
                if await request.is_disconnected():
                    return
                continue
            if reason and reason.startswith("error"):
                yield _sse(error_body(f"generation failed: {reason[7:]}", "server_error"))
                return
            if text or reason:
                yield chunk(i, text, reason)
            left -= reason is not None
        if body.stream_options and body.stream_options.include_usage:
            yield _sse({"id": rid, "object": obj, "created": created, "model": s.model_id, "choices": [],
                        "usage": _usage(prompt_tokens, jobs)})
        yield "data: [DONE]\n\n"
    finally:  # the client went away (the response is cancelled) or the stream ended: free the slots
        for job in jobs:
            if job.finish_reason is None:
                s.engine.cancel(job)


def _usage(prompt_tokens: int, jobs: list[Job]) -> dict:
    completion = sum(len(j.tokens) for j in jobs)
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion, "total_tokens": prompt_tokens + completion}


def _sse(obj) -> str:
    return f"data: {json.dumps(obj)}\n\n"
