"""Serving throughput and latency, reported as `vllm bench serve` reports them.

    python tools/serve_bench.py --config recipes/debug_llama.toml [--sets mix,fixed] [--concurrency 1,8,32,64]
        [--requests 64] [--max-tokens 128] [--max-seqs 32] [--url http://HOST:PORT | --engine [--peer transformers]
        [--decode eager,static]]
        [--json FILE] [--profile FOLDER]
        [--section.key=value ...]

Starts `python -m torchmeg.serve` on the recipe's newest checkpoint (or uses the server at --url),
then for each prompt set and concurrency sends the same requests through that many client threads,
streamed, greedy, `ignore_eos` (each generates --max-tokens). Prompt sets, real text (the standard
library's argparse.py, tokenized by the server's /tokenize) sent as token ids of exact lengths:
`mix`, lengths spread evenly over 10..1,000 tokens; `fixed`, 12..139 tokens; `shared`, 410 tokens of
which the first 400 are the same in every request (prefix caching's case), and `unrelated`, 410 tokens
each from elsewhere in the text (the same work without a shared prefix). Per row: request
throughput, output tokens/s and its ratio to concurrency 1 (one by one), time to first token
(TTFT), time per output token after the first (TPOT), inter-token latency (ITL, every gap between
streamed tokens), mean / median / p99. `--engine`: the same requests through the serving engine in
this process, no HTTP (the engine's own scaling, apart from the server's). `--peer transformers` (with
--engine): the model exported as checkpoint.export_hf writes it (llama and hf models) and run by
transformers' continuous batching (`generate_batch`: paged cache, block sharing on, --max-seqs
requests a batch) on the same requests, greedy; one line per set: both throughputs side by side, the
ratio, and how many requests got the same tokens. `--decode eager,static` (with --engine): every set and
concurrency with the eager decode step and with the static one (batching.static_decode), side by side,
and a line per pair: TPOT and throughput ratios, the graphs compiled, the decode steps by padded size.
`--profile FOLDER` (with --engine): each set's last
concurrency run once more, profiled (the rows are not): its steps (what each forward held, its time
with the device synchronized), torch's profiler tables by host and by device time, and a summary in
the row (`profile`) (how an H200's serving was found host-bound in cuDNN's attention:
docs/gpu-results.md). One run, side by side: the ratios are the result; the
absolute numbers are this machine's.
"""
from __future__ import annotations

import argparse
import asyncio
import http.client
import json
import os
import socket
import subprocess
import sys
import time
from urllib.parse import urlparse

from serve_bench_engine import compare_peer, engine_runner  # (tools/, this script's folder, is on the path)
from serve_bench_stats import summarize

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


async def request(host: str, port: int, body: dict) -> dict:
    """One streamed completion over a raw asyncio connection (HTTP/1.1, chunked server-sent events; a
    light client: it shares this machine's cores with the server) -> its TTFT, end-to-end latency,
    token times and count."""
    t0 = time.perf_counter()
    reader, writer = await asyncio.open_connection(host, port)
    data = json.dumps(body).encode()
    writer.write(f"POST /v1/completions HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n"
                 f"Content-Length: {len(data)}\r\n\r\n".encode() + data)
    status = await reader.readline()
    headers = {}
    while (line := await reader.readline()) not in (b"\r\n", b""):
        k, _, v = line.decode().partition(":")
        headers[k.strip().lower()] = v.strip()
    if b" 200 " not in status:
        raise SystemExit(f"serve_bench: the server answered {status!r}: {await reader.read(300)!r}")
    stamps, tokens, buf = [], 0, b""
    while True:
        if headers.get("transfer-encoding") == "chunked":
            size = int((await reader.readline()).strip() or b"0", 16)
            piece = await reader.readexactly(size + 2) if size else b""
            piece = piece[:-2]
        else:
            piece = await reader.read(65536)
        if not piece:
            break
        buf += piece
        *events, buf = buf.split(b"\n\n")
        for ev in events:
            ev = ev.strip()
            if not ev.startswith(b"data: ") or ev == b"data: [DONE]":
                continue
            chunk = json.loads(ev[6:])
            if chunk.get("usage"):
                tokens = chunk["usage"]["completion_tokens"]
            elif chunk["choices"] and chunk["choices"][0].get("text"):
                stamps.append(time.perf_counter() - t0)
    writer.close()
    end = time.perf_counter() - t0
    ttft = stamps[0] if stamps else end
    return dict(ttft=ttft, e2e=end, tokens=tokens, itl=[b - a for a, b in zip(stamps, stamps[1:])],
                tpot=(end - ttft) / (tokens - 1) if tokens > 1 else 0.0)


def prompt_sets(ids: list[int], n: int, names: list[str]) -> dict[str, list[list[int]]]:
    """Token-id prompts cut from real text: `mix` 10..1,000 tokens (evenly spread, shuffled by the
    golden ratio), `fixed` 12..139."""
    lengths = {"mix": [10 + round(990 * ((i * 0.6180339887) % 1)) for i in range(n)],
               "fixed": [12 + (37 * i) % 128 for i in range(n)], "unrelated": [410] * n}
    out = {}
    for name in names:
        if name == "shared":  # one 400-token prefix (a system prompt, few-shot examples), 10 tokens each after it
            out[name] = [ids[:400] + ids[1000 + 10 * i:][:10] for i in range(n)]
            continue
        if name not in lengths:
            raise SystemExit(f"serve_bench: --sets {name!r}: the sets are mix, fixed, shared, unrelated")
        out[name] = [ids[(997 * i) % (len(ids) - L):][:L] for i, L in enumerate(lengths[name])]
    return out


def start_server(args, rest) -> tuple[subprocess.Popen, str]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cmd = [sys.executable, "-m", "torchmeg.serve", "--config", args.config, "--port", str(port),
           "--max-seqs", str(args.max_seqs), "--max-queue", str(args.requests)] + rest
    proc = subprocess.Popen(cmd, cwd=ROOT, stderr=subprocess.PIPE, text=True)
    deadline = time.time() + 120
    while time.time() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"serve_bench: the server exited {proc.returncode}:\n{proc.stderr.read()[-3000:]}")
        try:
            c = http.client.HTTPConnection("127.0.0.1", port, timeout=2)
            c.request("GET", "/health")
            if c.getresponse().status == 200:
                return proc, f"http://127.0.0.1:{port}"
        except OSError:
            time.sleep(0.3)
    proc.kill()
    raise SystemExit("serve_bench: the server did not start in 120 s")


def run(host, port, bodies: list[dict], concurrency: int) -> dict:
    async def all_of_them():
        gate = asyncio.Semaphore(concurrency)

        async def one(b):
            async with gate:
                return await request(host, port, b)
        return await asyncio.gather(*(one(b) for b in bodies))
    t0, cpu0 = time.perf_counter(), time.process_time()
    got = asyncio.run(all_of_them())
    return summarize(got, time.perf_counter() - t0, (time.process_time() - cpu0) / (time.perf_counter() - t0),
                     concurrency)


def sampling_words(args) -> str:
    """The requests' sampling, as the header says it."""
    if not args.temperature:
        return "greedy" + (f", presence penalty {args.presence_penalty:g}" if args.presence_penalty else "")
    return (f"sampled (temperature {args.temperature:g}, top_p {args.top_p:g}, presence penalty "
            f"{args.presence_penalty:g}, seeded)")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--config", default="recipes/debug_llama.toml")
    ap.add_argument("--url", default="", help="a running server (default: start one on the recipe)")
    ap.add_argument("--sets", default="mix,fixed")
    ap.add_argument("--concurrency", default="1,8,32,64")
    ap.add_argument("--requests", type=int, default=64)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--max-seqs", type=int, default=32)
    ap.add_argument("--json", default="")
    ap.add_argument("--profile", default="", help="with --engine: the last concurrency run once more, profiled: its "
                                                  "step times and torch profiler tables into this folder")
    ap.add_argument("--temperature", type=float, default=0.0, help="every request's (0: greedy); seeded by its index")
    ap.add_argument("--top-p", type=float, default=1.0)
    ap.add_argument("--presence-penalty", type=float, default=0.0)
    ap.add_argument("--engine", action="store_true", help="the engine in this process, no HTTP (its own scaling)")
    ap.add_argument("--decode", default="", help="with --engine: eager,static runs every set and concurrency with each "
                    "decode step, side by side (batching.static_decode; default: the server's --static-decode)")
    ap.add_argument("--peer", default="", choices=["", "transformers"],
                    help="with --engine: also transformers' continuous batching on the exported model, same requests")
    args, rest = ap.parse_known_args()
    if args.peer and not args.engine:
        raise SystemExit("serve_bench: --peer transformers runs beside --engine (both in this process)")
    if args.peer and (args.temperature or args.presence_penalty):
        raise SystemExit("serve_bench: --peer compares greedy tokens: leave --temperature and --presence-penalty at 0")
    modes = [m for m in args.decode.split(",") if m]
    if modes and (not args.engine or set(modes) - {"eager", "static"}):
        raise SystemExit("serve_bench: --decode takes eager and/or static, with --engine")
    if args.profile and not args.engine:
        raise SystemExit("serve_bench: --profile profiles the engine in this process: add --engine")
    proc, url = (None, "") if args.engine or args.url else start_server(args, rest)
    url = url or args.url
    try:
        if args.engine:
            model, ids, run_one = engine_runner(args, rest)
            where = "this process"
        else:
            u = urlparse(url)
            model = json.loads(_call(u.hostname, u.port, "GET", "/v1/models"))["data"][0]["id"]
            text = open(os.path.join(os.path.dirname(os.__file__), "argparse.py"), encoding="utf-8").read()
            ids = json.loads(_call(u.hostname, u.port, "POST", "/tokenize", {"model": model, "prompt": text}))["tokens"]
            run_one, where = (lambda bodies, c: run(u.hostname, u.port, bodies, c)), url
        sets = prompt_sets(ids, args.requests, args.sets.split(","))
        rows, peers = [], []
        for name, prompts in sets.items():
            bodies = [dict(model=model, prompt=p, max_tokens=args.max_tokens, temperature=args.temperature,
                           top_p=args.top_p, presence_penalty=args.presence_penalty, seed=i, ignore_eos=True,
                           stream=True, stream_options={"include_usage": True}) for i, p in enumerate(prompts)]
            set_rows = []
            for mode in modes or [""]:
                kw = dict(decode=mode) if mode else {}
                # warm up: the first shapes, allocations; a static step's compile (on a CPU one graph; on a
                # GPU a batch of 1 and the rest are two, which 2 requests at once reach)
                run_one(bodies[:1], 1, **kw)
                if mode == "static":
                    run_one(bodies[:2], 2, **kw)
                mode_rows = [dict(run_one(bodies, c, **kw), set=name) for c in [int(x) for x in args.concurrency.split(",")]]
                for r in mode_rows:
                    r["vs_first"] = round(r["output_tokens_per_sec"] / max(mode_rows[0]["output_tokens_per_sec"], 1e-9), 2)
                set_rows += mode_rows
            if not all(r["output_tokens_per_sec"] > 0 for r in set_rows):
                raise SystemExit(f"serve_bench: set {name}: a run produced no tokens (its errors above)")
            if args.profile:  # once more at the last concurrency (and --decode mode), profiled (the rows above are not)
                run_one(bodies, set_rows[-1]["concurrency"], profile=True, **({"decode": modes[-1]} if modes else {}))
                set_rows[-1]["profile"] = run_one.profile
            rows += set_rows
            if args.peer:
                peers.append(compare_peer(name, bodies, args.max_seqs, run_one))
        lengths = {k: (min(map(len, v)), max(map(len, v))) for k, v in sets.items()}
        print(f"serve_bench: {model} at {where}, {args.requests} requests x {args.max_tokens} output tokens, "
              f"{sampling_words(args)}; "
              + "; ".join(f"set {k}: prompts {a}-{b} tokens" for k, (a, b) in lengths.items())
              + f"; concurrency {rows[0]['concurrency']} is the baseline")
        print("| set | concurrency | req/s | output tok/s | vs one by one | TTFT mean / median / p99 (ms) | "
              "TPOT mean / median / p99 (ms) | ITL mean / median / p99 (ms) |")
        print("|---|---:|---:|---:|---:|---|---|---|")
        for r in rows:
            label = f"{r['set']}, {r['decode']} decode" if modes else r["set"]
            print(f"| {label} | {r['concurrency']} | {r['request_throughput']:.2f} | "
                  f"{r['output_tokens_per_sec']:,.0f} | {r['vs_first']:.2f}x | "
                  + " | ".join(" / ".join(f"{r[f'{k}_{s}_ms']:,.0f}" for s in ("mean", "median", "p99"))
                               for k in ("ttft", "tpot", "itl")) + " |")
        by = {(r["set"], r["concurrency"]): r for r in rows}
        for c in [int(x) for x in args.concurrency.split(",")]:
            if ("shared", c) in by and ("unrelated", c) in by:
                a, b = by[("shared", c)], by[("unrelated", c)]
                print(f"shared prefix vs unrelated prompts at concurrency {c}: {b['seconds'] / a['seconds']:.2f}x "
                      f"faster in all, TTFT median {b['ttft_median_ms'] / max(a['ttft_median_ms'], 1e-9):.2f}x lower")
        by_mode = {(r["set"], r["concurrency"], r.get("decode")): r for r in rows}
        for (name, c, mode), r in by_mode.items():
            e = by_mode.get((name, c, "eager"))
            if mode == "static" and e:
                print(f"static vs eager decode, {name} at concurrency {c}: TPOT median {r['tpot_median_ms']:.2f} vs "
                      f"{e['tpot_median_ms']:.2f} ms ({e['tpot_median_ms'] / max(r['tpot_median_ms'], 1e-9):.2f}x), output "
                      f"tok/s {r['output_tokens_per_sec'] / e['output_tokens_per_sec']:.2f}x; {r['compiles']} graphs "
                      f"compiled in all, decode steps by padded size {r['steps_by_size']}")
        for r in rows:
            if "most_running" in r:  # (--engine: the paged KV pool's use)
                print(f"KV pool {r['set']} at concurrency {r['concurrency']}: {r['kv_blocks']:,} blocks of {r['kv_block_size']}, at most "
                      f"{r['most_running']} sequences at once, {r['preemptions']} preemptions, "
                      f"{r['kv_positions_written']:,} positions written")
        for line in peers:
            print(line)
        if args.json:
            with open(args.json, "w") as fh:
                json.dump(rows, fh, indent=1)
    finally:
        if proc is not None:
            proc.terminate()
            proc.wait(60)


def _call(host, port, method, path, body=None) -> str:
    c = http.client.HTTPConnection(host, port, timeout=60)
    c.request(method, path, None if body is None else json.dumps(body), {"Content-Type": "application/json"})
    return c.getresponse().read().decode()


if __name__ == "__main__":
    try:
        main()
    except Exception as e:  # a recipe or checkpoint problem: one line, as every torchmeg command says it
        # (by name: with --url this tool runs where torchmeg is not installed, so it imports none of it here)
        if type(e).__name__ != "ConfigError":
            raise
        sys.exit(f"serve_bench: error: {e}")
