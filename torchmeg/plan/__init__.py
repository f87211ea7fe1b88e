"""The planner: `python -m torchmeg.plan --config RECIPE` (see __main__.py). dry_run measures one
training step per rank on fake tensors at the real world size, step_cost counts its ops and
collectives, predict turns that into step time, MFU and fit on a GPU (gpus), search ranks layouts,
measure takes the same numbers from a real run."""
