"""Every shipped recipe parses and validates for the world size it names (plan.world_size; the CPU
recipes at 1). Recipes whose tokenizer and corpus the user supplies are validated without them
(tests/test_plan.py checks the one-line error they give when run as they are)."""
import glob
import os

import pytest

from conftest import ROOT
from torchmeg.config.schema import load_config
from torchmeg.train.validate import validate


@pytest.mark.parametrize("path", sorted(glob.glob(os.path.join(ROOT, "recipes", "*.toml"))))
def test_recipe_validates(path):
    cfg = load_config(path)
    users_data = cfg.data.tokenizer != "byte" and not os.path.isfile(cfg.data.tokenizer)
    validate(cfg, world_size=cfg.plan.world_size or 1, data=not users_data)
