"""tools/gpu_check.py's environment record and its markdown report (the tables docs/gpu-results.md
holds): one section per step, its status, and its rows under the columns named here."""
from __future__ import annotations

import importlib.metadata
import os
import platform
import subprocess

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _version(dist: str) -> str:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return "not installed"


def environment(cpu: bool) -> dict:
    import torch  # lazy: the caller decides when torch loads (after its arguments are checked)
    cuda = torch.cuda.is_available() and not cpu
    try:
        # --dirty: the tree that ran differs from the commit (a lent machine's copy of the working tree
        # came with the session's first commit and the files of its last edit, 2026-11-30)
        commit = subprocess.run(["git", "describe", "--always", "--abbrev=7", "--dirty=+changes"], cwd=ROOT,
                                capture_output=True, text=True, timeout=10).stdout.strip() or "unknown"
    except (OSError, subprocess.SubprocessError):
        commit = "unknown (no git here)"
    return {"device": torch.cuda.get_device_name() if cuda else f"CPU ({platform.processor() or platform.machine()}, "
                                                                  f"{os.cpu_count()} cores)",
            "torch": torch.__version__, "cuda": torch.version.cuda if cuda else None,
            "torchao": _version("torchao"), "torchdata": _version("torchdata"), "triton": _version("triton"),
            "python": platform.python_version(), "commit": commit}


def _f(v, spec: str) -> str:
    if v is None or v == "":
        return "—"
    if isinstance(v, (list, tuple)):
        return ", ".join(str(x) for x in v) or "—"
    if spec and isinstance(v, (int, float)):
        return format(v, spec)
    return str(v).replace("|", "/")


COLUMNS = {
    "bench": [("setting", "setting", ""), ("median step (ms)", "median_step_ms", ".1f"),
              ("tokens/s", "tokens_per_sec", ",.0f"), ("MFU", "mfu", ".1%"), ("peak memory (GiB)", "memory_gib", ".2f"),
              ("tensors' peak (GiB)", "memory_allocated_gib", ".2f"), ("compile (s)", "compile_s", ".1f"),
              ("loss at the last step", "last_loss", ".4f"),
              ("vs the first row", "speedup", ".2f")],
    "fused_ce": [("way", "way", ""), ("forward + backward (ms)", "ms", ".2f"), ("peak above inputs (GiB)", "peak_gib", ".3f"),
                 ("fake-tensor prediction (GiB)", "predicted_peak_gib", ".3f"), ("loss", "loss", ".5f"),
                 ("loss vs unfused", "loss_rel_diff", ".1e"), ("dh vs unfused", "grad_h_rel_diff", ".1e"),
                 ("dW vs unfused", "grad_w_rel_diff", ".1e")],
    "sink_attention": [("way", "way", ""), ("forward (ms)", "forward_ms", ".3f"),
                       ("forward + backward (ms)", "forward_backward_ms", ".3f"), ("vs plain", "vs_plain", ".2f"),
                       ("SDPA kernels", "sdpa_kernels", "")],
    "serving": [("set", "set", ""), ("decode", "decode", ""), ("concurrency", "concurrency", ""), ("output tokens/s", "output_tokens_per_sec", ",.0f"),
                ("vs one by one", "vs_first", ".2f"), ("TTFT mean (ms)", "ttft_mean_ms", ",.1f"),
                ("TTFT median (ms)", "ttft_median_ms", ",.1f"), ("TPOT mean (ms)", "tpot_mean_ms", ",.2f"),
                ("compiles", "compiles", "")],
    "planner": [("setting", "setting", ""), ("predicted step (ms)", "predicted_step_ms", ".4g"),
                ("measured step (ms)", "measured_step_ms", ".4g"), ("measured / predicted", "measured_over_predicted_step", ".2f"),
                ("predicted MFU", "predicted_mfu", ".1%"), ("measured MFU", "measured_mfu", ".1%"),
                ("predicted memory (GiB)", "predicted_memory_gib", ".3g"), ("measured memory (GiB)", "measured_memory_gib", ".3g"),
                ("measured, tensors (GiB)", "measured_allocated_gib", ".3g"), ("error", "error", "")],
    "gpu_suite": [("test", "test", ""), ("outcome", "outcome", ""), ("seconds", "seconds", ".1f"), ("message", "message", "")],
}
_COLUMNS_OF = {"compile_vs_eager": "bench", "float8": "bench"}


def table(step: str, rows: list[dict]) -> str:
    cols = COLUMNS.get(_COLUMNS_OF.get(step, step))
    if cols is None:  # a step without its own columns: every key of its rows
        keys = list(dict.fromkeys(k for r in rows for k in r))
        cols = [(k, k, "") for k in keys]
    head = "| " + " | ".join(c[0] for c in cols) + " |\n|" + "---|" * len(cols) + "\n"
    return head + "".join("| " + " | ".join(_f(r.get(k), spec) for _, k, spec in cols) + " |\n" for r in rows)


def markdown(report: dict) -> str:
    env = report["environment"]
    lines = [f"## gpu_check: {env['device']}, {report['when']}\n",
             f"torch {env['torch']} (CUDA {env['cuda']}), torchao {env['torchao']}, torchdata {env['torchdata']}, "
             f"triton {env['triton']}, Python {env['python']}, torchmeg {env['commit']}; {report['mode']}, "
             f"{report['seconds']:.0f} s in all.\n"]
    for s in report["steps"]:
        status = s["status"] + (f" in {s['seconds']:.0f} s" if "seconds" in s else "")
        lines.append(f"\n### {s['step']}: {status}\n")
        if "why" in s:
            lines.append(f"\n{s['why']}\n")
        for key in ("shape", "note", "pytest"):
            if key in s:
                lines.append(f"\n{s[key]}\n")
        if s.get("rows"):
            lines.append("\n" + table(s["step"], s["rows"]))
    return "".join(lines)
