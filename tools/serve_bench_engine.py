"""tools/serve_bench.py's in-process runners: `--engine`, the same requests through torchmeg's serving
engine in this process (no HTTP: the engine's own scaling), with `--decode eager,static` and
`--profile`; and `--peer transformers`, the model exported and run by transformers' continuous
batching on the same requests. Each returns a row as serve_bench_stats.summarize makes it."""
from __future__ import annotations

import gc
import json
import os
import time

from serve_bench_stats import progress, summarize


def engine_runner(args, rest):
    """--engine: the same requests through torchmeg's serving engine in this process, no HTTP (the
    engine's own scaling, apart from the server's): each of `concurrency` clients submits its next
    request when its last one ends. -> (model id, token ids of the text, run(bodies, c) -> row)."""
    from torchmeg.batching.generation import Sampling  # lazy: --engine only (torch, the model)
    from torchmeg.inference.trained import load_trained
    from torchmeg.serving import cli
    from torchmeg.batching.engine import Engine
    from torchmeg.batching.scheduler import Job
    t_load = time.perf_counter()
    a, cfg, layout, _, _ = cli.prepare(["--config", args.config] + rest, http=False)
    loaded = load_trained(cfg, layout, logits=True, kv_copies=a.kv_copies)
    progress(f"the model loaded in {time.perf_counter() - t_load:.1f} s")
    a.max_seqs = args.max_seqs
    cli.size_engine(a, loaded.built.model, loaded.device)  # the server's dtype and slot length
    max_len = a.max_model_len

    default_static = cli.static_step(a, cfg, loaded.built.model, loaded.device)
    if "static" in args.decode and not default_static:  # (forced: its kernels in this ISA's cache too)
        from torchmeg.parallel.compile import setup  # lazy: only when the static step runs
        setup(cfg.compile.cache_dir)

    def run_engine(bodies: list[dict], concurrency: int, profile: bool = False, decode: str = "") -> dict:
        static = default_static if not decode else decode == "static"
        engine = Engine(loaded.built.model, loaded.tokenizer, loaded.device, args.max_seqs, max_len, len(bodies),
                        a.prefill_tokens, prefix_caching=a.prefix_caching, num_blocks=a.num_blocks,
                        static_decode=static)
        engine.reserve()  # (the KV pool, allocated at start as the server does: not in the first request's time)
        records, ended = [], []

        def submit(body):
            rec = dict(t0=time.perf_counter(), stamps=[])
            records.append(rec)

            def on_event(text, ids, reason):
                if ids:
                    rec["stamps"].append(time.perf_counter() - rec["t0"])
                if reason is not None:
                    rec["end"] = time.perf_counter() - rec["t0"]
                    ended.append(rec)
            sampling = Sampling(temperature=body["temperature"], top_p=body["top_p"], seed=body["seed"])
            job = Job(list(body["prompt"]), body["max_tokens"], sampling, on_event=on_event,
                      presence=body["presence_penalty"])
            rec["job"] = job
            engine.submit(job)
        queue = list(bodies)
        steps, profiler = step_log(engine, loaded.device) if profile else (None, None)
        t0, cpu0 = time.perf_counter(), time.process_time()
        for _ in range(min(concurrency, len(queue))):
            submit(queue.pop(0))
        most = 0
        while engine.running or engine.waiting:
            engine.step()
            most = max(most, len(engine.running))
            while ended:
                ended.pop()
                if queue:
                    submit(queue.pop(0))
        wall = time.perf_counter() - t0
        if steps is not None:
            run_engine.profile = write_profile(args.profile, concurrency, steps, profiler)
        progress(f"{len(bodies)} requests at concurrency {concurrency}: {wall:.1f} s")
        kv = dict(most_running=most, preemptions=engine.scheduler.preemptions, kv_blocks=engine.pool.usable,
                  kv_block_size=engine.pool.block_size, kv_positions_written=engine.cache.written,
                  decode="static" if static else "eager")
        if static:  # (the compiled step's graphs so far, the decode steps by padded size; why it fell back, if it did)
            st = engine.runner.static
            kv.update(compiles=st.compiles if st else 0, steps_by_size=dict(st.steps) if st else {},
                      static_failed=engine.runner.static_failed)
        # (a collection before the next run's engine reserves its own pool: a 1B's on an H200 ran out of
        # memory at the second run when a reference cycle kept the last one)
        engine = None
        gc.collect()
        got = []
        run_engine.tokens = [list(r["job"].tokens) for r in records]  # (in the bodies' order: --peer compares)
        for r in records:
            n, st = len(r["job"].tokens), r["stamps"]
            ttft = st[0] if st else r["end"]
            got.append(dict(ttft=ttft, e2e=r["end"], tokens=n, itl=[b - a for a, b in zip(st, st[1:])],
                            tpot=(r["end"] - ttft) / (n - 1) if n > 1 else 0.0))
        return dict(summarize(got, wall, (time.process_time() - cpu0) / wall, concurrency), **kv)
    text = open(os.path.join(os.path.dirname(os.__file__), "argparse.py"), encoding="utf-8").read()
    run_engine.loaded, run_engine.cfg, run_engine.layout = loaded, cfg, layout
    return cfg.job.name + " (in process)", loaded.tokenizer.encode(text), run_engine


def transformers_runner(run_engine, max_seqs: int):
    """--peer transformers: the same model exported (checkpoint.export_hf's folder) and loaded by
    transformers, the same requests through its continuous batching (`generate_batch`: paged cache,
    block sharing on, at most max_seqs requests a batch: the concurrency), greedy, every request its
    max_tokens. One call of all the requests (generate_batch has no clients arriving one at a time):
    compare with the engine's row at concurrency = max_seqs. -> run(bodies, c) -> row, with each
    request's tokens kept to compare."""
    import tempfile
    import torch  # lazy: --peer only
    from transformers import AutoModelForCausalLM, GenerationConfig
    from transformers.generation.configuration_utils import ContinuousBatchingConfig
    from torchmeg.checkpoint.export import export_hf
    loaded, cfg = run_engine.loaded, run_engine.cfg
    folder = tempfile.mkdtemp(prefix="serve_bench_hf_")
    export_hf(loaded.built.model, run_engine.layout.args, cfg, folder)
    hf = AutoModelForCausalLM.from_pretrained(folder, dtype=next(loaded.built.model.parameters()).dtype,
                                              attn_implementation="sdpa").eval()

    def run_peer(bodies: list[dict], concurrency: int) -> dict:
        n = bodies[0]["max_tokens"]
        gen = GenerationConfig(do_sample=False, max_new_tokens=n, min_new_tokens=n, eos_token_id=None, pad_token_id=0)
        longest = max(len(b["prompt"]) for b in bodies) + n
        cb = ContinuousBatchingConfig(page_size=16, num_blocks=concurrency * (-(-longest // 16)) + 16,
                                      max_batch_tokens=max(512, concurrency), max_requests_per_batch=concurrency,
                                      allow_block_sharing=True, auto_switch_to_flash=False, use_cuda_graph=False)
        t0, cpu0 = time.perf_counter(), time.process_time()
        with torch.no_grad():
            out = hf.generate_batch([list(b["prompt"]) for b in bodies], generation_config=gen,
                                    continuous_batching_config=cb, record_timestamps=True, warmup=False)
        wall = time.perf_counter() - t0
        got, tokens = [], []
        for rid in sorted(out, key=lambda r: int(r.split("_")[-1]) if r.split("_")[-1].isdigit() else r):
            o = out[rid]
            st = [x - t0 for x in (o.timestamps or [])]
            end = st[-1] if st else wall
            ttft = st[0] if st else end
            k = len(o.generated_tokens)
            tokens.append(list(o.generated_tokens))
            got.append(dict(ttft=ttft, e2e=end, tokens=k, itl=[b - a for a, b in zip(st, st[1:])],
                            tpot=(end - ttft) / (k - 1) if k > 1 else 0.0))
        row = summarize(got, wall, (time.process_time() - cpu0) / wall, concurrency)
        row["_tokens"] = tokens
        return row
    return run_peer


def compare_peer(name: str, bodies: list[dict], max_seqs: int, run_engine) -> str:
    """The engine at concurrency max_seqs and transformers' generate_batch at max_seqs a batch, run one
    after the other on the same requests: one line, the ratio and how many requests got the same tokens."""
    peer = getattr(run_engine, "peer", None) or transformers_runner(run_engine, max_seqs)
    run_engine.peer = peer
    ours = run_engine(bodies, max_seqs)  # (the engine ran these requests before, in the table: warm)
    our_tokens = run_engine.tokens
    peer(bodies, max_seqs)  # warm up as the engine was: the same requests once (first shapes, allocations)
    theirs = peer(bodies, max_seqs)
    same = sum(a == b for a, b in zip(our_tokens, theirs["_tokens"]))
    ratio = ours["output_tokens_per_sec"] / theirs["output_tokens_per_sec"]
    return (f"set {name}: torchmeg's engine {ours['output_tokens_per_sec']:,.0f} output tok/s vs transformers' "
            f"generate_batch {theirs['output_tokens_per_sec']:,.0f} ({ratio:.2f}x), TTFT mean "
            f"{ours['ttft_mean_ms']:,.0f} vs {theirs['ttft_mean_ms']:,.0f} ms, {max_seqs} sequences a batch; the same "
            f"greedy tokens in {same} of {len(bodies)} requests")


def step_log(engine, device):
    """--profile: each engine step's forward timed (the device synchronized: slower, so only in a
    profiled run) with what its plan held, and torch's profiler over the run. -> (steps, profiler)."""
    import torch  # lazy: --engine only
    from torch.profiler import ProfilerActivity, profile
    steps, forward = [], engine.runner.forward
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)

    def timed(plan):
        sync()
        t = time.perf_counter()
        out = forward(plan)
        sync()
        steps.append(dict(ms=round(1000 * (time.perf_counter() - t), 2), prefill=len(plan.prefill),
                          prefill_tokens=sum(len(c[2]) for c in plan.prefill), decode_rows=len(plan.rows)))
        return out
    engine.runner.forward = timed
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    profiler = profile(activities=activities)
    profiler.__enter__()
    return steps, profiler


def write_profile(folder: str, concurrency: int, steps: list[dict], profiler) -> dict:
    """The profiled run's files (steps_c<N>.json, ops_c<N>.txt) -> its summary: the forwards' time, the
    host's and the device's time in ops, the ops that took the most host time (share of the host's) and,
    on a GPU, the kernels that took the most device time (which attention kernel SDPA picked, say)."""
    profiler.__exit__(None, None, None)
    os.makedirs(folder, exist_ok=True)
    ops = profiler.key_averages()
    with open(os.path.join(folder, f"steps_c{concurrency}.json"), "w") as fh:
        json.dump(steps, fh)
    with open(os.path.join(folder, f"ops_c{concurrency}.txt"), "w") as fh:
        for key in ("self_cpu_time_total", "self_device_time_total"):
            fh.write(ops.table(sort_by=key, row_limit=30) + "\n")
    host = sum(e.self_cpu_time_total for e in ops) / 1000
    device = sum(getattr(e, "self_device_time_total", 0) for e in ops) / 1000
    top = sorted(ops, key=lambda e: -e.self_cpu_time_total)[:3]
    summary = dict(concurrency=concurrency, steps=len(steps), forward_ms=round(sum(x["ms"] for x in steps), 1),
                   host_ms=round(host, 1), device_ms=round(device, 1),
                   top_host_ops=[dict(op=e.key, ms=round(e.self_cpu_time_total / 1000, 1), calls=e.count,
                                      share=round(e.self_cpu_time_total / 1000 / max(host, 1e-9), 3)) for e in top])
    on_device = sorted((e for e in ops if getattr(e, "self_device_time_total", 0) > 0),
                       key=lambda e: -e.self_device_time_total)[:5]
    summary["top_device_ops"] = [dict(op=e.key, ms=round(e.self_device_time_total / 1000, 1), calls=e.count,
                                      share=round(e.self_device_time_total / 1000 / max(device, 1e-9), 3))
                                 for e in on_device]
    progress(f"profile of concurrency {concurrency}: {len(steps)} steps, their forwards {summary['forward_ms']:.0f} ms; "
             f"host {host:.0f} ms, device {device:.0f} ms; most host time: "
             + ", ".join(f"{t['op']} {100 * t['share']:.0f}%" for t in summary["top_host_ops"]) + f" -> {folder}")
    return summary
