"""A fault-tolerance drill: the same job twice through python -m torchmeg.replicas (2 groups x FSDP2 2 on
this machine, over loopback), once healthy and once with group 1's rank 1 SIGKILLed as step K's backward
starts, and what the kill cost, side by side (docs/fault-tolerance.md quotes a run):

    python tools/ft_drill.py [--steps 60] [--kill_step 5] [--out /tmp/ft_drill] [-- extra recipe overrides]

Printed: detection latency (the kill to the survivor's discarded step, from the lines' arrival times),
the survivor's discarded steps, its longest step during the outage vs its median, the rejoin split
(the agent's restart, imports, build, quorum + transfer: the heal line's own split), the bytes healed,
and goodput (committed tokens per second of the job's wall time) vs the healthy run's.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MODEL = ["--model.dim=256", "--model.n_layers=4", "--data.seq_len=256", "--training.local_batch_size=4",
         "--validation.enable=false", "--checkpoint.enable=false", "--metrics.log_freq=1",
         "--metrics.enable_tensorboard=false", "--lr_scheduler.warmup_steps=2", "--fault_tolerance.log_weights_hash=true"]
GROUP_TOKENS = 4 * 256 * 2  # local batch x seq x the group's 2 ranks


def run(out: str, steps: int, extra: list[str], env: dict) -> tuple[list[tuple[float, str]], float, list[list[dict]]]:
    """-> (timestamped lines, wall seconds, [group 0's rows, group 1's rows])."""
    shutil.rmtree(out, ignore_errors=True)
    cmd = [sys.executable, "-m", "torchmeg.replicas", "--groups=2", "--nproc_per_node=2", "--max_restarts=1",
           "--heartbeat_timeout_ms=2000", "--join_timeout_ms=30000", "--config", "recipes/debug_llama.toml",
           f"--job.dump_folder={out}", "--job.name=run", *MODEL, f"--training.steps={steps}", *extra]
    t0 = time.time()
    p = subprocess.Popen(cmd, cwd=ROOT, env=dict(os.environ, PYTHONUNBUFFERED="1", **env), stdout=subprocess.PIPE,
                         stderr=subprocess.STDOUT, text=True)
    lines = [(time.time() - t0, line.rstrip("\n")) for line in p.stdout]
    if p.wait() != 0:
        sys.exit("\n".join(x for _, x in lines[-40:]) + f"\nft_drill: the run in {out} failed")
    rows = []
    for g in range(2):
        with open(os.path.join(out, "run", f"replica_{g}", "metrics.jsonl")) as fh:
            rows.append([json.loads(x) for x in fh])
    return lines, time.time() - t0, rows


def first(lines, pattern: str, group: int | None = None):
    for t, line in lines:
        if (group is None or line.startswith(f"[replica {group}] ")) and re.search(pattern, line):
            return t, line
    return None, None


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--kill_step", type=int, default=5)
    ap.add_argument("--out", default="/tmp/ft_drill")
    args, extra = ap.parse_known_args()
    extra = [x for x in extra if x != "--"]
    _, wall_ok, (ok0, _) = run(os.path.join(args.out, "healthy"), args.steps, extra, {})
    lines, wall_kill, (g0, g1) = run(os.path.join(args.out, "kill"), args.steps, extra,
                                     {"TORCHMEG_TEST_FT_KILL": f"1:1:{args.kill_step}"})
    t_kill, _ = first(lines, r"SIGKILL to itself", 1)
    t_disc, disc = first(lines, r"\| discarded \(", 0)
    t_heal, heal = first(lines, r"healed\s+from replica group", 1)
    if None in (t_kill, t_disc, t_heal):
        sys.exit("ft_drill: the kill, the survivor's discarded step or the heal is missing from the log")
    split = dict((k, float(v)) for k, v in re.findall(r"(imports|build|quorum \+ transfer) ([\d.]+) s", heal.split("this process:")[1]))
    healed_at = int(re.search(r"at step (\d+)", heal)[1])
    alone = [r for r in g0 if r["replicas"] == 1]
    outage = [r["elapsed_ms"] for r in g0 if args.kill_step <= r["step"] <= healed_at + 1]
    median = statistics.median(r["elapsed_ms"] for r in ok0)
    mib = re.search(r"([\d.,]+ MiB) on rank 0", heal)[1]
    restart = (t_heal - t_kill) - sum(split.values())
    print(f"ft drill: 2 replica groups x FSDP2 2 on this machine, {args.steps} steps; group 1 rank 1 SIGKILLed in "
          f"step {args.kill_step}'s backward")
    print(f"  detection: the survivor discarded its step {t_disc - t_kill:.2f} s after the kill "
          f"({disc.split('discarded (', 1)[1][:70]}...)")
    print(f"  survivor: {g0[-1]['steps_discarded']} step(s) discarded, {len(alone)} steps alone, never restarted; "
          f"longest step during the outage {max(outage):.0f} ms vs a healthy median of {median:.0f} ms "
          f"({max(outage) / median:.1f}x)")
    print(f"  rejoin: {t_heal - t_kill:.1f} s from the kill to the heal = the agent's restart {restart:.1f} s + imports "
          f"{split['imports']:.1f} s + build {split['build']:.1f} s + quorum and transfer {split['quorum + transfer']:.2f} s; "
          f"healed at step {healed_at} ({mib} per rank)")
    good_kill = sum(r["replicas"] for r in g0) * GROUP_TOKENS / wall_kill
    good_ok = sum(r["replicas"] for r in ok0) * GROUP_TOKENS / wall_ok
    print(f"  goodput (committed tokens of every group / the job's wall time): {good_kill:,.0f} tokens/s vs "
          f"{good_ok:,.0f} healthy ({good_kill / good_ok:.2f}x); {args.steps} steps in {wall_kill:.1f} s vs {wall_ok:.1f} s")
    agree = all(a.get("weights_hash") == b.get("weights_hash") for a in g0 for b in g1 if a["step"] == b["step"] > healed_at)
    print(f"  after the heal the groups agree at every step: {agree}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
