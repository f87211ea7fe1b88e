"""Run by test_init.py in its own process: every shipped model flavor, at its recipe's layout (a
flavor no recipe ships: FSDP 8), built as rank 0 of a fake process group through the trainer's own
build (meta model, pipeline split, the real parallelize()); then, for every parameter rank 0 holds,
the block the trainer's init fills (its shard's offset in the full tensor, from the same
computation DCP and `local_block` use) drawn by the init code with the parameter's own rule and
seed, and checked: finite, and the sample's mean and std within 5 standard errors of the rule's.

A shard is sampled, not filled whole: rank 0 of llama3_8b / 70b / 405b holds 0.8-1.1 G elements
each (~45 s apiece here; tools/init_bench.py times the full fill). At most SAMPLE elements per
parameter (whole rows from the shard's first row, so row offsets and column offsets are both
exercised). The generator itself is tested over 2^26 draws in test_init.py.
Prints one JSON line per flavor."""
import json
import math
import sys

import torch
import torch.distributed as dist

SAMPLE = 1 << 15

CASES = [  # (recipe, model, flavor); recipe None: the debug recipe with that flavor at FSDP 8
    ("recipes/debug_llama.toml", None, None), ("recipes/gpt2_124m.toml", None, None),
    ("recipes/moe_debug.toml", None, None), ("recipes/llama3_8b.toml", None, None),
    ("recipes/llama3_8b_long_context.toml", None, None), ("recipes/llama3_70b.toml", None, None),
    ("recipes/llama3_405b.toml", None, None),
    (None, "llama", "1B"), (None, "gpt2", "debug"), (None, "gpt2", "350M"), (None, "gpt2", "774M"),
    (None, "gpt2", "1.5B"), (None, "moe", "mixtral-8x7B"), (None, "moe", "deepseek-v3-like"),
]


def sample_block(shape, offset, local_shape):
    """A sub-block of this rank's block: whole rows (up to SAMPLE elements) from its first row."""
    if not local_shape:
        return (), ()
    row = math.prod(local_shape[1:]) if len(local_shape) > 1 else 1
    if len(local_shape) == 1:
        return (min(local_shape[0], SAMPLE),), tuple(offset)
    inner = list(local_shape[1:])
    while math.prod(inner) > SAMPLE and inner[0] > 1:  # a very wide row: fewer of its leading dims
        inner[0] = max(1, inner[0] // 2)
        row = math.prod(inner)
    return (max(1, min(local_shape[0], SAMPLE // row)), *inner), tuple(offset)


def check_flavor(recipe, model_name, flavor) -> dict:
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    from torchmeg.train.build import build_parallel_model
    from torchmeg.config.schema import load_config
    from torchmeg.models.init import Constant, canonical_fqn, fill_block_, param_seed
    from torchmeg.plan.fake_world import fake_world
    from torchmeg.plan.planner import recipe_world
    from torchmeg.train.validate import validate
    if recipe is None:
        cfg = load_config("recipes/debug_llama.toml", [f"--model.name={model_name}", f"--model.flavor={flavor}"])
        world = 8
    else:
        cfg = load_config(recipe, [])
        world = recipe_world(cfg)[0]
    cfg.checkpoint.enable = False
    layout = validate(cfg, world, data=False)
    dims = layout.dims
    fake_world(world, 0)
    fake = FakeTensorMode(allow_non_fake_inputs=True)
    built = build_parallel_model(cfg, layout, dims.build_mesh("cpu"), dims.build_ep_mesh("cpu"), torch.device("cpu"),
                                 None, schedule=False, storage=lambda: fake)
    n_params, sampled, worst, stds, seen = 0, 0, 0.0, set(), set()
    bad = []
    for part in built.parts:
        for name, p in part.named_parameters():
            fqn = canonical_fqn(name)
            if fqn in seen:
                continue
            seen.add(fqn)
            if hasattr(p, "device_mesh"):
                local_shape, offset = compute_local_shape_and_global_offset(p.shape, p.device_mesh, p.placements)
            else:
                local_shape, offset = tuple(p.shape), (0,) * p.dim()
            if math.prod(local_shape) == 0:
                continue
            n_params += 1
            rule = part.init_rule(fqn)
            shape, off = sample_block(tuple(p.shape), offset, tuple(local_shape))
            x = fill_block_(torch.empty(shape), rule, param_seed(cfg.job.seed, fqn), p.shape, off).double()
            sampled += x.numel()
            if not torch.isfinite(x).all():
                bad.append(f"{fqn}: non-finite")
                continue
            if isinstance(rule, Constant):
                if not bool((x == rule.value).all()):
                    bad.append(f"{fqn}: not the constant {rule.value}")
                continue
            stds.add(rule.std)
            n = x.numel()
            if n < 64:
                continue
            z_mean = abs(x.mean().item() - rule.mean) / (rule.std / n ** 0.5)
            z_std = abs(x.std().item() / rule.std - 1) / (1 / (2 * n) ** 0.5)
            worst = max(worst, z_mean, z_std)
            if z_mean > 5 or z_std > 5:
                bad.append(f"{fqn}: mean {x.mean().item():.3g} std {x.std().item():.3g} vs rule {rule}")
    dist.destroy_process_group()
    return {"case": recipe or f"{model_name}/{flavor}", "world": world, "layout": dims.describe(),
            "params": n_params, "sampled": sampled, "worst_z": worst, "stds": sorted(stds), "bad": bad}


def main():
    torch.set_num_threads(1)
    for case in CASES:
        print(json.dumps(check_flavor(*case)), flush=True)


if __name__ == "__main__":
    sys.exit(main())
