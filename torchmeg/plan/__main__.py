"""python -m torchmeg.plan --config RECIPE [--world N] [--gpu h100|h100-500w|h200|b200|a100 | --device cpu]
                          [--calibration FILE] [--search] [--json FILE] [--section.key=value ...]
   python -m torchmeg.plan --calibrate [--out FILE] [--budget S]      (under torchrun: the collectives too)

Plans a recipe at its real world size on this machine: no GPU, no peers. One training step runs
on fake tensors over torch's fake process group for a representative rank of each pipeline stage
(torchmeg.plan.dry_run), through the trainer's own build and the real parallelize(); per rank it
reports parameter / gradient / optimizer / activation memory and the peak, bytes per collective and
mesh dim, FLOPs, and a predicted step time and MFU on the named GPU (torchmeg.plan.predict).
--search tries other layouts of the same world (tp, pp, cp, dp_shard, recompute, local batch at the
same global batch) and ranks those that fit by predicted step time.

--calibrate measures the device it runs on (torchmeg.plan.calibrate); --calibration FILE predicts from
such a file op by op, and --device cpu plans this machine from its own (torchmeg.plan.calibrated).

Under torchrun, --measure runs the real trainer instead and measures its step 2 the same way:
the numbers the plan predicts, taken from a real run (tests compare the two).
"""
from __future__ import annotations

import argparse
import json
import os
import sys

from torchmeg.config.schema import load_config
from torchmeg.config.errors import ConfigError
from torchmeg.plan.calibrate import BUDGET, calibrate_main
from torchmeg.plan.gpus import GPUS
from torchmeg.plan.measure import measure_main
from torchmeg.plan.planner import plan, recipe_world
from torchmeg.plan.search import search

GIB = 2 ** 30


def parse(argv):
    ap = argparse.ArgumentParser(prog="python -m torchmeg.plan", description=__doc__.split("\n\n")[1],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", default=None)
    ap.add_argument("--calibrate", action="store_true",
                    help="measure this device (matmuls, attention, memory-bound ops, an eager op's cost; under torchrun "
                         "the collectives too) and write a calibration file for --calibration (torchmeg.plan.calibrate)")
    ap.add_argument("--budget", type=float, default=BUDGET,
                    help=f"--calibrate: seconds each table may take at most (default {BUDGET:g}; less measures fewer sizes)")
    ap.add_argument("--out", default=None, help="--calibrate: the file written (default: ~/.cache/torchmeg/"
                                                "calibration-<device>-<ranks>rank.json)")
    ap.add_argument("--world", type=int, default=None, help="world size (default: what the recipe's layout implies)")
    ap.add_argument("--gpu", default=None, help="h100 | h100-500w | h200 | b200 | a100 (default: the recipe's plan.gpu, else h100)")
    ap.add_argument("--device", default=None, choices=["cpu"],
                    help="cpu: plan for this machine as calibrated (--calibration, else its default calibration)")
    ap.add_argument("--calibration", default=None,
                    help="a calibration file (--calibrate wrote it): predict from what that device measured")
    ap.add_argument("--gpus-per-node", type=int, default=None,
                    help="ranks per node (default: the GPU's usual node, 8): groups inside a node use its fast links")
    ap.add_argument("--search", action="store_true", help="rank other layouts of the same world that fit")
    ap.add_argument("--top", type=int, default=8, help="layouts shown by --search")
    ap.add_argument("--limit", type=int, default=0, help="layouts --search plans at most (0: every candidate)")
    ap.add_argument("--json", default=None, help="write the plan as JSON here")
    ap.add_argument("--measure", action="store_true", help="(under torchrun) measure the real trainer's step 2")
    return ap.parse_known_args(argv)


def _g(b: float) -> str:
    return f"{b / GIB:.2f}"


def render(p: dict) -> str:
    lines = [f"plan  {p['recipe']}: {p['model']}, {p['params'] / 1e9:.2f}B params, {p['layout']}, "
             f"{p['precision']}, recompute {p['recompute']}, seq {p['seq_len']}, "
             f"{p['global_batch_tokens']:,} tokens/step, on {p['gpu']} ({p['gpu_memory_bytes'] / 1e9:.0f} GB)",
             "",
             "rank  stages    params  grads   optim   activ.  peak    need    fits   (GiB per rank; activ. = "
             "activations, temporaries, gathered weights)"]
    for r in p["ranks"]:
        st = ",".join(map(str, r["stages"])) if r["pipeline"] else "-"
        lines.append(f"{r['rank']:<5} {st:<9} {_g(r['param_bytes']):<7} {_g(r['grad_bytes']):<7} "
                     f"{_g(r['optimizer_bytes']):<7} {_g(r['activation_bytes']):<7} {_g(r['peak_bytes']):<7} "
                     f"{_g(r['need_bytes']):<7} {'yes' if r['fits'] else 'NO'}")
    for r in p["ranks"]:
        if r.get("rollout_peak_bytes") is not None:
            lines.append(f"rank {r['rank']}: GRPO's rollout peaks at {_g(r['rollout_peak_bytes'])} GiB (every FSDP module "
                         f"unsharded, the KV cache of its rows, their packed prefill; or the old policy's / reference's "
                         f"log-prob forwards after it; in the peak above when larger)")
    for r in p["ranks"]:
        lines += ["", f"rank {r['rank']}: bytes per step by mesh dim / collective"
                  f"   (count, buffer GiB, sent per rank GiB, seconds at peak, predicted exposed seconds)"]
        for key, c in r["comm"].items():
            lines.append(f"  {key:<28} {c['count']:>6} {_g(c['bytes']):>9} {_g(c['wire_bytes']):>9} "
                         f"{r['comm_s'].get(key, 0.0):>8.4f} {r['predicted_comm_exposed_by'].get(key, 0.0):>8.4f}")
        pipe = r["pipeline"]
        lines.append(f"  compute {r['compute_s']:.3f} s ({r['flops'] / 1e12:.1f} TFLOP measured; flop-bound "
                     f"{r['compute_flop_bound_s']:.3f} s, memory-bound {r['compute_memory_bound_s']:.3f} s), "
                     f"comm exposed {r['comm_exposed_s']:.3f} s, overlapped {r['comm_overlapped_s']:.3f} s"
                     + (f", bubble {r['bubble']:.3f} ({pipe['schedule']}, {pipe['microbatches']} microbatches)"
                        if pipe else "")
                     + f" -> step {r['step_s']:.3f} s")
    lines += ["", f"predicted: step {p['predicted_step_s']:.3f} s, {p['predicted_tokens_per_s_per_gpu']:,.0f} tokens/s "
              f"per GPU, MFU {100 * p['predicted_mfu']:.1f}% ({_source(p)})",
              f"upper bound: step {p['step_s']:.3f} s, {p['tokens_per_s_per_gpu']:,.0f} tokens/s per GPU, "
              f"MFU {100 * p['mfu']:.1f}% (roofline at data-sheet peaks), "
              f"{'fits' if p['fits'] else 'DOES NOT FIT'} in {p['gpu_memory_bytes'] / 1e9:.0f} GB "
              f"(peak x 1.1 + 2 GiB runtime)   [dry run {p['dry_run_s']:.1f} s{_traced(p)}]"]
    return "\n".join(lines)


def _source(p: dict) -> str:
    """Where the predicted step's rates came from."""
    if p.get("calibration"):
        return f"this device as measured: {p['calibration']}"
    return "measured kernel efficiencies: torchmeg.plan.efficiency"


def _traced(p: dict) -> str:
    """What the dry run traced: a few layers scaled to the depth (torchmeg.plan.depth), or all."""
    traced = p["ranks"][0].get("traced_layers") or []
    cached = f", {p['traces_cached']} of {p['traces']} traces read from plan.trace_cache" if p.get("traces_cached") else ""
    if len(traced) < 2:
        return cached
    return f", layers traced {' + '.join(map(str, traced))} and scaled by kind" + cached


def main(argv=None) -> int:
    a, rest = parse(sys.argv[1:] if argv is None else argv)
    if a.calibrate:
        return calibrate_main(a.out, a.budget)
    if a.config is None:
        print("torchmeg.plan: error: --config RECIPE is required (or --calibrate)", file=sys.stderr, flush=True)
        return 2
    try:
        cfg = load_config(a.config, rest)
        if a.measure:
            return measure_main(cfg, a.json)
        world, source = (a.world, "--world") if a.world else recipe_world(cfg)
        if source.startswith("parallelism."):  # (the header says why this world)
            print(f"world {world}: {source}", flush=True)
        gpu = "cpu" if a.device == "cpu" else (a.gpu or cfg.plan.gpu).lower()
        if gpu not in GPUS and gpu != "cpu":
            raise ConfigError(f"--gpu {gpu!r}: unknown; one of {', '.join(GPUS)} (or --device cpu)")
        cfg.plan.gpu = gpu  # (the dry run builds the program of the device planned for)
        if a.calibration:
            cfg.plan.calibration = a.calibration
        if a.search:
            result = search(cfg, world, gpu, a.top, a.limit, a.gpus_per_node)
        else:
            result = plan(cfg, world, gpu, gpus_per_node=a.gpus_per_node)
            print(render(result), flush=True)
    except ConfigError as e:
        print(f"torchmeg.plan: error: {e}", file=sys.stderr, flush=True)
        return 2
    if a.json:
        os.makedirs(os.path.dirname(os.path.abspath(a.json)), exist_ok=True)
        with open(a.json, "w") as fh:
            json.dump(result, fh, indent=1, default=str)
    return 0


if __name__ == "__main__":
    code = main()
    sys.stdout.flush()
    os._exit(code)  # no interpreter teardown of fake process-group state
