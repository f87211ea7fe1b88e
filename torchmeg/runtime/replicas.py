"""python -m torchmeg.replicas --groups N --nproc_per_node K [options] --config RECIPE [overrides]

One machine's fault-tolerant job (a laptop over loopback, or one node): torchft's lighthouse, then N
replica groups, each a torchmeg.launch (torchrun) job of K ranks of its own, restarted by its agent up to
--max_restarts times when one of its ranks dies; the groups find each other through the lighthouse. Each
group's lines come out prefixed `[replica i]` (and into --log_dir/replica_<i>.log when given). On a
cluster the same pieces are started by the scheduler instead (docs/fault-tolerance.md has a Slurm script):
one lighthouse, and per group `python -m torchmeg.launch ... -m torchmeg.train --config R
--fault_tolerance.enable=true --fault_tolerance.replica_id=i --fault_tolerance.group_size=N` with
TORCHFT_LIGHTHOUSE set.

Exit: 0 when every group finished, else the first failing group's code (each group's own lines say why).
SIGTERM / SIGINT are passed on to the groups (a checkpoint is saved as without fault tolerance).
"""
from __future__ import annotations

import argparse
import os
import shutil
import signal
import subprocess
import sys
import threading
import uuid

from torchmeg.runtime.ports import unused_port

PROG = "torchmeg.replicas"


def parse(argv: list[str]) -> tuple[argparse.Namespace, list[str]]:
    p = argparse.ArgumentParser(prog=f"python -m {PROG}", description=__doc__.split("\n\n")[1])
    p.add_argument("--groups", type=int, required=True, help="replica groups (fault_tolerance.group_size)")
    p.add_argument("--nproc_per_node", type=int, default=1, help="ranks per group (its data/model parallel world)")
    p.add_argument("--min_replicas", type=int, default=1, help="the lighthouse's quorum minimum")
    p.add_argument("--max_restarts", type=int, default=3, help="restarts of a group (its torchrun agent's)")
    p.add_argument("--lighthouse_port", type=int, default=0, help="0 = a free port")
    p.add_argument("--join_timeout_ms", type=int, default=60000,
                   help="how long a quorum waits for a heartbeating group to join (torchft's default)")
    p.add_argument("--heartbeat_timeout_ms", type=int, default=5000,
                   help="a group silent this long is left out of the quorum (torchft's default)")
    p.add_argument("--log_dir", default="", help="also write each group's lines to <log_dir>/replica_<i>.log")
    args, train_args = p.parse_known_args(argv)
    if args.groups < 1 or args.nproc_per_node < 1:
        p.error("--groups and --nproc_per_node must be at least 1")
    if not any(a == "--config" or a.startswith("--config=") for a in train_args):
        p.error("give the recipe: --config recipes/X.toml (then any --section.key=value overrides)")
    return args, train_args


def _pump(stream, prefix: str, log) -> None:
    for line in iter(stream.readline, ""):
        sys.stdout.write(prefix + line)
        sys.stdout.flush()
        if log is not None:
            log.write(line)
            log.flush()


def main(argv: list[str] | None = None) -> int:
    args, train_args = parse(sys.argv[1:] if argv is None else argv)
    binary = shutil.which("torchft_lighthouse") or os.path.join(os.path.dirname(sys.executable), "torchft_lighthouse")
    if not os.path.exists(binary):
        print(f"{PROG}: error: fault tolerance needs torchft (its lighthouse), which is not installed: "
              f"pip install 'torchmeg[ft]'", file=sys.stderr, flush=True)
        return 2
    port = args.lighthouse_port or unused_port()
    lighthouse = subprocess.Popen(
        [binary, "--min_replicas", str(args.min_replicas), "--bind", f"[::]:{port}", "--quorum_tick_ms", "100",
         "--join_timeout_ms", str(args.join_timeout_ms), "--heartbeat_timeout_ms", str(args.heartbeat_timeout_ms)],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    env = dict(os.environ, TORCHFT_LIGHTHOUSE=f"http://127.0.0.1:{port}")
    env.setdefault("TORCHMEG_FT_JOB_ID", uuid.uuid4().hex)  # a group restarted after the end knows it is over
    env.setdefault("RUST_LOG", "warn")  # torchft's managers log several INFO lines a step otherwise
    if args.log_dir:
        os.makedirs(args.log_dir, exist_ok=True)
    print(f"[{PROG}] lighthouse on port {port} (quorum of at least {args.min_replicas}); {args.groups} groups x "
          f"{args.nproc_per_node} ranks, up to {args.max_restarts} restarts each", flush=True)
    groups, pumps, logs = [], [], []
    for i in range(args.groups):
        cmd = [sys.executable, "-m", "torchmeg.launch", "--nnodes=1", f"--nproc_per_node={args.nproc_per_node}",
               "--rdzv-backend=c10d", f"--rdzv-endpoint=127.0.0.1:{unused_port()}", f"--rdzv-id=replica_{i}",
               f"--max-restarts={args.max_restarts}", "-m", "torchmeg.train", *train_args,
               "--fault_tolerance.enable=true", f"--fault_tolerance.replica_id={i}",
               f"--fault_tolerance.group_size={args.groups}"]
        proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                start_new_session=True)
        log = open(os.path.join(args.log_dir, f"replica_{i}.log"), "w") if args.log_dir else None
        t = threading.Thread(target=_pump, args=(proc.stdout, f"[replica {i}] ", log), daemon=True)
        t.start()
        groups.append(proc)
        pumps.append(t)
        logs.append(log)

    def forward(signum, _frame):
        for g in groups:
            if g.poll() is None:
                os.killpg(g.pid, signum)
    old = {s: signal.signal(s, forward) for s in (signal.SIGTERM, signal.SIGINT)}
    try:
        codes = [g.wait() for g in groups]
    finally:
        for s, h in old.items():
            signal.signal(s, h)
        lighthouse.terminate()
        try:
            lighthouse.wait(timeout=10)
        except subprocess.TimeoutExpired:
            lighthouse.kill()
        for t in pumps:
            t.join(timeout=5)
        for log in logs:
            if log is not None:
                log.close()
    failed = [(i, c) for i, c in enumerate(codes) if c != 0]
    if failed:
        print(f"{PROG}: error: replica group(s) {', '.join(str(i) for i, _ in failed)} failed (exit "
              f"{', '.join(str(c) for _, c in failed)}); their lines above say why", file=sys.stderr, flush=True)
        return failed[0][1] if failed[0][1] > 0 else 1
    return 0
