"""tools/serve_bench.py's numbers: the rows `vllm bench serve` prints (a run's requests summarized:
throughput, TTFT, TPOT, ITL, end-to-end; mean, median, p99) and the stage lines on stderr. Shared by the
HTTP client (serve_bench) and the in-process runners (serve_bench_engine)."""
from __future__ import annotations

import statistics
import sys


def pct(xs: list[float], p: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(p / 100 * (len(xs) - 1))))] if xs else 0.0


def summarize(got: list[dict], wall: float, cpu_share: float, concurrency: int) -> dict:
    tokens = sum(g["tokens"] for g in got)
    row = dict(concurrency=concurrency, requests=len(got), output_tokens=tokens, seconds=round(wall, 3),
               client_cpu_share=round(cpu_share, 3),
               request_throughput=round(len(got) / wall, 3), output_tokens_per_sec=round(tokens / wall, 1))
    for key, xs in (("ttft", [g["ttft"] for g in got]), ("tpot", [g["tpot"] for g in got if g["tokens"] > 1]),
                    ("itl", [x for g in got for x in g["itl"]]), ("e2e", [g["e2e"] for g in got])):
        row[f"{key}_mean_ms"] = round(1000 * statistics.fmean(xs), 2) if xs else 0.0
        row[f"{key}_median_ms"] = round(1000 * statistics.median(xs), 2) if xs else 0.0
        row[f"{key}_p99_ms"] = round(1000 * pct(xs, 99), 2)
    return row


def progress(line: str) -> None:
    """One line per stage on stderr, as it ends: a run stopped at its bound shows how far it got (the
    first H200 call's bench printed nothing in its 76 s)."""
    print(f"serve_bench: {line}", file=sys.stderr, flush=True)
