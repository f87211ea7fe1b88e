"""Every shipped recipe parses and validates for the world size it names (plan.world_size; the CPU
recipes at 1). Recipes whose tokenizer and corpus the user supplies are validated without them
(tests/test_plan.py checks the one-line error they give when run as they are); recipes that start
from another run's checkpoint (sft_debug from debug_llama's, dpo_debug from sft_debug's) are validated
without it when that run has not happened here, and give the one-line error naming the key."""
import glob
import os

import pytest

from launch import ROOT
from torchmeg.checkpoint.folder import committed_steps
from torchmeg.config.errors import ConfigError
from torchmeg.config.schema import load_config
from torchmeg.train.validate import validate


@pytest.mark.parametrize("path", sorted(glob.glob(os.path.join(ROOT, "recipes", "*.toml"))))
def test_recipe_validates(path):
    cfg = load_config(path)
    users_data = cfg.data.tokenizer != "byte" and not os.path.isfile(cfg.data.tokenizer)
    world = cfg.plan.world_size or 1
    start = cfg.checkpoint.initial_load_path
    if start and not users_data and not committed_steps(os.path.join(ROOT, start)):
        with pytest.raises(ConfigError, match="checkpoint.initial_load_path = .*train the model it names first"):
            validate(cfg, world_size=world)
        cfg.checkpoint.initial_load_path = ""  # the rest of the recipe, as on a machine that ran the first one
    validate(cfg, world_size=world, data=not users_data)
