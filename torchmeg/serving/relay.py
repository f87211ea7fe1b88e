"""Rank 0's side of the pipe to the API process (serving.frontend): start it, submit and cancel the
requests it sends, send back each step's events in one message, and end together.

Lifecycle: SIGTERM (or Ctrl-C) to rank 0 is passed to the API process, which drains up to
--drain-timeout and exits; then the engine cancels whatever is left and stops (the other TP ranks
with it) and rank 0 exits 0. If the API process dies, rank 0 stops too; if the engine fails (a TP
peer died), the API process is stopped and rank 0 exits non-zero; if rank 0 dies, the API process
sees its pipe close and exits.
"""
from __future__ import annotations

import multiprocessing as mp
import os
import signal
import threading

from torchmeg.serving.frontend import FrontendSpec
from torchmeg.serving.frontend import main as frontend_main


def cancel(engine, jobs: dict, key: int) -> None:
    """The API's cancel of `key`: the engine's thread pops a job from `jobs` when it finishes, between
    any two of this thread's steps, so the job is read once (`key in jobs` then `jobs[key]` raised
    KeyError when the finish fell between them, ending the thread that reads requests: a silent hang)."""
    job = jobs.get(key)
    if job is not None:
        engine.cancel(job)


def serve(engine, spec: FrontendSpec) -> None:
    ctx = mp.get_context("spawn")  # (a fresh interpreter: no model, no CUDA context, no threads of ours)
    ours, theirs = ctx.Pipe()
    api = ctx.Process(target=frontend_main, args=(theirs, spec), name="torchmeg-api", daemon=True)
    api.start()
    theirs.close()
    jobs, outbox, send_lock = {}, [], threading.Lock()
    stopping, failed = threading.Event(), []

    def on_event_for(key, job):
        first = [True]

        def on_event(text, ids, reason):
            score = job.token_logprobs[-1] if ids and job.logprobs >= 0 and job.token_logprobs else None
            prompt_scores = job.prompt_token_logprobs if first[0] and job.prompt_logprobs else None
            cached = job.cached_prompt if first[0] else None  # the prompt done: how much of it was copied
            outbox.append((key, text, list(ids), reason, score, prompt_scores, cached))
            first[0] = False
            if reason is not None:
                jobs.pop(key, None)
        return on_event

    def flush(steps: int) -> None:
        stats = engine.stats()
        events = outbox[:]
        del outbox[:len(events)]
        if events or steps:
            with send_lock:
                ours.send((steps, stats, events))

    def requests():  # the API's requests, until its pipe closes
        try:
            while True:
                kind, key, *rest = ours.recv()
                if kind == "submit":
                    job = rest[0]
                    job.on_event = on_event_for(key, job)
                    jobs[key] = job
                    engine.submit(job)
                else:
                    cancel(engine, jobs, key)
        except (EOFError, OSError):
            pass
        for job in list(jobs.values()):  # nobody is listening for them any more
            engine.cancel(job)
        stopping.set()
        with engine.cond:
            engine.cond.notify()

    def run_engine():
        try:
            engine.serve(stopping, on_step=lambda: flush(1))
        except BaseException as e:  # noqa: BLE001 - under TP a failed step ends the server
            failed.append(e)
            stopping.set()
        finally:
            try:
                flush(0)  # (the failed step's error events)
            except (OSError, ValueError):
                pass
            if failed:
                api.kill()

    reader = threading.Thread(target=requests, name="torchmeg-requests", daemon=True)
    engine_thread = threading.Thread(target=run_engine, name="torchmeg-engine", daemon=True)
    reader.start()
    engine_thread.start()
    for sig in (signal.SIGTERM, signal.SIGINT):  # drain: the API process stops taking requests and finishes
        signal.signal(sig, lambda *_: os.kill(api.pid, signal.SIGTERM) if api.is_alive() else None)
    api.join()
    ours.close()
    stopping.set()
    with engine.cond:
        engine.cond.notify()
    engine_thread.join()
    if failed:
        raise failed[0]
    if api.exitcode not in (0, None):
        raise SystemExit(f"the API server process exited {api.exitcode}")
