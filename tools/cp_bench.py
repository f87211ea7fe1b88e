#!/usr/bin/env python
"""Context-parallel attention: memory, time, bytes and work per step vs sequence length, per mode.

    python tools/cp_bench.py --cp 2 --seq 1024,2048,4096,8192 --modes dense,allgather,ring,alltoall

Each (mode, seq_len) runs in fresh processes (cp ranks under torchrun, gloo, one thread each):
forward + backward of one attention call on the rank's load-balanced shard of q/k/v (batch 1,
--heads query heads, --kv-heads kv heads, --head-dim), `--steps` times. Reported (rank 0):
median step time, the attention path's peak memory (the process high-water mark VmHWM above the
RSS once q/k/v exist; VmHWM is reset through /proc/self/clear_refs), bytes sent per step by the
collectives (CommDebugMode, extended with sizes), and attention work in query x key pairs.

`dense` is the kernel torchmeg had before block attention: K/V repeated to every query head, then
all-gathered, and one SDPA under a local_len x seq_len boolean mask. Writes <out>/cp_bench.md,
.json and .png.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)


def _status(field: str) -> int:
    with open("/proc/self/status") as fh:
        for line in fh:
            if line.startswith(field):
                return int(line.split()[1]) * 1024
    return 0


class DenseAllGather:
    """The pre-block-attention kernel, kept here only as the baseline."""

    def __init__(self, mesh):
        self.group, self.rank, self.size = mesh.get_group(), mesh.get_local_rank(), mesh.size()

    def __call__(self, q, k, v):
        import torch
        import torch.nn.functional as F
        import torch.distributed._functional_collectives as funcol
        from torchmeg.parallel.context import positions
        rep = q.shape[1] // k.shape[1]
        k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)

        # all_gather_single_autograd from torch 2.12; all_gather_tensor_autograd, its older name, before
        gather_autograd = getattr(funcol, "all_gather_single_autograd", None) or funcol.all_gather_tensor_autograd

        def gather(x):
            return gather_autograd(x.permute(2, 0, 1, 3).contiguous(), 0, self.group).permute(1, 2, 0, 3)
        L = q.shape[2]
        k_all, v_all = gather(k), gather(v)
        q_pos = positions(L, self.rank, self.size, q.device)
        k_pos = torch.cat([positions(L, r, self.size, q.device) for r in range(self.size)])
        return F.scaled_dot_product_attention(q, k_all, v_all, attn_mask=k_pos[None, :] <= q_pos[:, None])


def worker(a) -> None:
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torchmeg.parallel import context as C
    from torchmeg.parallel.comm_bytes import CommBytes
    dist.init_process_group("gloo")
    cp = dist.get_world_size()
    mesh = init_device_mesh("cpu", (cp,), mesh_dim_names=("cp",))
    r = mesh.get_local_rank()
    attn = {"dense": lambda: DenseAllGather(mesh), "alltoall": lambda: C.UlyssesAttention(mesh)}.get(
        a.mode, lambda: C.BlockAttention(mesh, a.mode))()
    g = torch.Generator().manual_seed(r)
    Ll = a.seq // cp
    q = torch.randn(1, a.heads, Ll, a.head_dim, generator=g, requires_grad=True)
    k = torch.randn(1, a.kv_heads, Ll, a.head_dim, generator=g, requires_grad=True)
    v = torch.randn(1, a.kv_heads, Ll, a.head_dim, generator=g, requires_grad=True)
    do = torch.randn(1, a.heads, Ll, a.head_dim, generator=g)

    def step():
        out = attn(q, k, v)
        out.backward(do)
        q.grad = k.grad = v.grad = None

    step()  # warm-up (allocator, thread pools)
    with CommBytes() as comm:
        C.PairCounter.reset()
        step()
    pairs, p2p = C.PairCounter.pairs, C.PairCounter.p2p_bytes
    if a.mode == "dense":  # one masked SDPA over local x whole sequence: every pair computed
        pairs = float(a.heads * Ll * a.seq)
    dist.barrier()
    import ctypes
    ctypes.CDLL("libc.so.6").malloc_trim(0)  # give freed heap back, so RSS is what is in use
    with open("/proc/self/clear_refs", "w") as fh:
        fh.write("5")  # VmHWM := current RSS
    base = _status("VmRSS:")
    times = []
    for _ in range(a.steps):
        dist.barrier()
        t0 = time.perf_counter()
        step()
        times.append(time.perf_counter() - t0)
    peak = _status("VmHWM:") - base
    res = {"mode": a.mode, "seq": a.seq, "cp": cp, "step_ms": 1000 * statistics.median(times),
           "attn_mem_mib": peak / 2 ** 20, "comm_bytes": sum(comm.get_comm_bytes().values()) + p2p,
           "pairs": pairs}
    out = [None] * cp
    dist.all_gather_object(out, res)
    if r == 0:
        worst = max(out, key=lambda x: x["attn_mem_mib"])
        res.update(attn_mem_mib=worst["attn_mem_mib"], step_ms=max(x["step_ms"] for x in out))
        print("RESULT " + json.dumps(res), flush=True)


def run_one(a, mode: str, seq: int) -> dict:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={a.cp}", __file__,
           "--worker", "--mode", mode, "--seq", str(seq), "--heads", str(a.heads), "--kv-heads", str(a.kv_heads),
           "--head-dim", str(a.head_dim), "--steps", str(a.steps)]
    # A fixed mmap threshold: tensors above 128 KiB are mapped and unmapped, so RSS follows what
    # is allocated (glibc's adaptive threshold would keep freed buffers and hide later peaks).
    env = dict(os.environ, OMP_NUM_THREADS="1", MALLOC_MMAP_THRESHOLD_="131072")
    p = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, env=env, timeout=a.timeout)
    line = next((x for x in p.stdout.splitlines() if x.startswith("RESULT ")), None)
    if p.returncode != 0 or line is None:
        raise SystemExit(f"cp_bench: {mode} at seq {seq} failed (exit {p.returncode}):\n{p.stderr[-3000:]}")
    return json.loads(line[len("RESULT "):])


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--cp", type=int, default=2)
    ap.add_argument("--seq", default="1024,2048,4096,8192")
    ap.add_argument("--modes", default="dense,allgather,ring,alltoall")
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--kv-heads", type=int, default=2)
    ap.add_argument("--head-dim", type=int, default=32)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--timeout", type=int, default=600)
    ap.add_argument("--out", default="outputs/cp_bench")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--mode", help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    if a.worker:
        a.seq = int(a.seq)
        worker(a)
        from torchmeg.runtime.process import finish_script  # lazy: the worker's process only
        finish_script()  # collect, barrier, destroy, leave without teardown (a gloo work in a cycle aborts it)
    seqs = [int(s) for s in a.seq.split(",")]
    modes = a.modes.split(",")
    rows = []
    print(f"cp {a.cp}, heads {a.heads}/{a.kv_heads}, head dim {a.head_dim}, batch 1, fwd+bwd of one attention call")
    print("| mode | seq | step (ms) | attention peak (MiB) | comm bytes/step | work (M q·k pairs) |")
    print("|---|---:|---:|---:|---:|---:|")
    for seq in seqs:
        for mode in modes:
            r = run_one(a, mode, seq)
            rows.append(r)
            print(f"| {mode} | {seq} | {r['step_ms']:.1f} | {r['attn_mem_mib']:.1f} | {r['comm_bytes']:,} | "
                  f"{r['pairs'] / 1e6:.2f} |", flush=True)
    os.makedirs(a.out, exist_ok=True)
    with open(os.path.join(a.out, "cp_bench.json"), "w") as fh:
        json.dump(rows, fh, indent=1)
    with open(os.path.join(a.out, "cp_bench.md"), "w") as fh:
        fh.write("| mode | seq | step (ms) | attention peak (MiB) | comm bytes/step | work (M q·k pairs) |\n|---|---:|---:|---:|---:|---:|\n")
        for r in rows:
            fh.write(f"| {r['mode']} | {r['seq']} | {r['step_ms']:.1f} | {r['attn_mem_mib']:.1f} | {r['comm_bytes']:,} | "
                     f"{r['pairs'] / 1e6:.2f} |\n")
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        fig, axes = plt.subplots(1, 2, figsize=(10, 4))
        for mode in modes:
            pts = [r for r in rows if r["mode"] == mode]
            axes[0].plot([r["seq"] for r in pts], [r["step_ms"] for r in pts], marker="o", label=mode)
            axes[1].plot([r["seq"] for r in pts], [r["attn_mem_mib"] for r in pts], marker="o", label=mode)
        for ax, title in zip(axes, ("step time (ms, fwd+bwd)", "attention peak memory (MiB)")):
            ax.set_xscale("log", base=2)
            ax.set_yscale("log")
            ax.set_xlabel("sequence length")
            ax.set_title(title)
            ax.legend()
        fig.suptitle(f"context parallel {a.cp}, heads {a.heads}/{a.kv_heads}, head dim {a.head_dim}")
        fig.tight_layout()
        fig.savefig(os.path.join(a.out, "cp_bench.png"), dpi=110)
    except ImportError:
        print("(matplotlib not installed: no PNG)")
    print(f"wrote {a.out}/cp_bench.md, .json, .png")
    return 0


if __name__ == "__main__":
    sys.exit(main())
