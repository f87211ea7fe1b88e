"""Serving throughput and latency: the same requests sent one by one, then by N concurrent clients.

    python tools/serve_bench.py --config recipes/debug_llama.toml [--concurrency 1,8,32] [--requests 64]
        [--max-tokens 64] [--max-seqs 32] [--url http://HOST:PORT] [--json FILE] [--section.key=value ...]

Starts `python -m torchmeg.serve` on the recipe's newest checkpoint (or uses the server at --url),
then for each concurrency sends the same requests (prompts cut from the standard library's source,
12 to 140 tokens, greedy, `ignore_eos` so each generates --max-tokens) through that many client
threads, streamed, and reports output tokens/s, its ratio to concurrency 1 (one by one), request
latency percentiles and time to first token. One run, side by side: the ratios are the result;
the absolute numbers are this machine's.
"""
from __future__ import annotations

import argparse
import http.client
import json
import os
import socket
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from urllib.parse import urlparse

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def request(host: str, port: int, body: dict) -> tuple[float, float, int]:
    """One streamed completion -> (seconds to the first token, seconds in all, tokens generated)."""
    t0 = time.perf_counter()
    c = http.client.HTTPConnection(host, port, timeout=600)
    c.request("POST", "/v1/completions", json.dumps(body), {"Content-Type": "application/json"})
    r = c.getresponse()
    if r.status != 200:
        raise SystemExit(f"serve_bench: the server answered {r.status}: {r.read()[:300]!r}")
    first, tokens = None, 0
    for line in r:
        line = line.strip()
        if not line.startswith(b"data: ") or line == b"data: [DONE]":
            continue
        chunk = json.loads(line[6:])
        if chunk.get("usage"):
            tokens = chunk["usage"]["completion_tokens"]
        elif first is None:
            first = time.perf_counter() - t0
    c.close()
    return first or 0.0, time.perf_counter() - t0, tokens


def prompts(n: int) -> list[str]:
    text = open(os.path.join(os.path.dirname(os.__file__), "argparse.py"), encoding="utf-8").read()
    return [text[(997 * i) % (len(text) - 200):][:12 + (37 * i) % 128] for i in range(n)]


def pct(xs: list[float], p: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(p / 100 * (len(xs) - 1))))]


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


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--config", default="recipes/debug_llama.toml")
    ap.add_argument("--url", default="", help="a running server (default: start one on the recipe)")
    ap.add_argument("--concurrency", default="1,8,32")
    ap.add_argument("--requests", type=int, default=64)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--max-seqs", type=int, default=32)
    ap.add_argument("--json", default="")
    args, rest = ap.parse_known_args()
    proc = None
    url = args.url or None
    if url is None:
        proc, url = start_server(args, rest)
    u = urlparse(url)
    try:
        model = json.loads(_get(u.hostname, u.port, "/v1/models"))["data"][0]["id"]
        bodies = [dict(model=model, prompt=p, max_tokens=args.max_tokens, temperature=0, ignore_eos=True, stream=True,
                       stream_options={"include_usage": True}) for p in prompts(args.requests)]
        request(u.hostname, u.port, bodies[0])  # warm up
        rows = []
        for c in [int(x) for x in args.concurrency.split(",")]:
            t0 = time.perf_counter()
            with ThreadPoolExecutor(c) as pool:
                got = list(pool.map(lambda b: request(u.hostname, u.port, b), bodies))
            wall = time.perf_counter() - t0
            tokens = sum(g[2] for g in got)
            rows.append(dict(concurrency=c, requests=len(bodies), output_tokens=tokens, seconds=round(wall, 3),
                             tokens_per_sec=round(tokens / wall, 1),
                             latency_p50=round(pct([g[1] for g in got], 50), 3),
                             latency_p90=round(pct([g[1] for g in got], 90), 3),
                             latency_p99=round(pct([g[1] for g in got], 99), 3),
                             ttft_p50=round(pct([g[0] for g in got], 50), 3)))
        base = rows[0]["tokens_per_sec"]
        print(f"serve_bench: {model} at {url}, {args.requests} requests x {args.max_tokens} tokens, prompts 12-139 "
              f"tokens, greedy; concurrency {rows[0]['concurrency']} is the baseline")
        print("| concurrency | output tokens/s | vs one by one | latency p50 / p90 / p99 (s) | first token p50 (s) |")
        print("|---:|---:|---:|---|---:|")
        for r in rows:
            r["vs_first"] = round(r["tokens_per_sec"] / base, 2)
            print(f"| {r['concurrency']} | {r['tokens_per_sec']:,.0f} | {r['vs_first']:.2f}x | "
                  f"{r['latency_p50']:.2f} / {r['latency_p90']:.2f} / {r['latency_p99']:.2f} | {r['ttft_p50']:.3f} |")
        if args.json:
            with open(args.json, "w") as fh:
                json.dump(rows, fh, indent=1)
    finally:
        if proc is not None:
            proc.terminate()
            proc.wait(60)


def _get(host, port, path) -> str:
    c = http.client.HTTPConnection(host, port, timeout=30)
    c.request("GET", path)
    return c.getresponse().read().decode()


if __name__ == "__main__":
    main()
