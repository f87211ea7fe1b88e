"""`[profiling]`: torch.profiler traces per rank every `profile_freq` steps, plus memory.

A window of `active_steps` steps ends every `profile_freq` steps (one warm-up step before it; the
rest of the cycle is not recorded, so the overhead stays inside the window). At the end of each
window every rank writes

  <run_dir>/profile/step-NNNNNN/rank{R}.trace.json     chrome trace (chrome://tracing, Perfetto)
  <run_dir>/profile/step-NNNNNN/rank{R}.memory_snapshot.pickle   CUDA: allocator history
                                                        (drag onto pytorch.org/memory_viz)
  <run_dir>/profile/step-NNNNNN/rank{R}.memory_ops.txt  CPU: memory allocated per operator
                                                        (the profiler's table; always written)
  <run_dir>/profile/step-NNNNNN/rank{R}.memory_timeline.html     CPU: the profiler's memory
                                                        timeline by category (params, grads, ...),
                                                        when torch's exporter succeeds: it sometimes
                                                        asserts (pytorch/pytorch#167838; seen here
                                                        on one rank in ~10 runs)
and rank 0 says where in the log; a rank whose timeline failed says so itself.
"""
from __future__ import annotations

import os
import sys
import warnings

import torch
from torch.profiler import ProfilerActivity, profile, schedule


class StepProfiler:
    def __init__(self, cfg, rank: int, device: torch.device):
        p = cfg.profiling
        self.enabled, self.rank, self.device = p.enable, rank, device
        self.memory = p.enable and p.memory
        self.root = os.path.join(cfg.run_dir, "profile")
        self._prof = None
        self._step = 0
        if not self.enabled:
            return
        acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
        active = p.active_steps
        sched = schedule(wait=p.profile_freq - active - 1, warmup=1, active=active, repeat=0)
        cpu_memory = self.memory and device.type != "cuda"
        self._prof = profile(activities=acts, schedule=sched, on_trace_ready=self._ready, record_shapes=True,
                             profile_memory=self.memory, with_stack=cpu_memory)
        if self.memory and device.type == "cuda":
            torch.cuda.memory._record_memory_history(max_entries=200_000)
        self._prof.__enter__()

    def step(self, step: int) -> None:
        if self._prof is not None:
            self._step = step
            self._prof.step()

    def _ready(self, prof) -> None:
        folder = os.path.join(self.root, f"step-{self._step:06d}")
        os.makedirs(folder, exist_ok=True)
        base = os.path.join(folder, f"rank{self.rank}")
        prof.export_chrome_trace(base + ".trace.json")
        written = ["trace"]
        if self.memory:
            try:
                if self.device.type == "cuda":
                    torch.cuda.memory._dump_snapshot(base + ".memory_snapshot.pickle")
                    written.append("memory snapshot")
                else:
                    with open(base + ".memory_ops.txt", "w") as fh:
                        fh.write(prof.key_averages().table(sort_by="self_cpu_memory_usage", row_limit=40))
                    written.append("memory per operator")
                    with warnings.catch_warnings():
                        warnings.simplefilter("ignore")  # deprecated in favour of a CUDA-only API
                        prof.export_memory_timeline(base + ".memory_timeline.html", device="cpu")
                    written.append("memory timeline")
            except Exception as e:  # noqa: BLE001 - a missing picture must not end a training run
                print(f"[profile] rank {self.rank} step {self._step}: no memory timeline "
                      f"({type(e).__name__}: {str(e)[:200]})", file=sys.stderr, flush=True)
        if self.rank == 0:
            print(f"[profile] step {self._step}: {', '.join(written)} per rank in {folder}", flush=True)

    def close(self) -> None:
        if self._prof is not None:
            self._prof.__exit__(None, None, None)
            self._prof = None
            if self.memory and self.device.type == "cuda":
                torch.cuda.memory._record_memory_history(enabled=None)
