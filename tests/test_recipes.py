"""Every shipped recipe parses and validates for the world size it documents."""
import glob
import os

import pytest

from conftest import ROOT
from torchmeg.config import load_config, validate

WORLD = {"llama3_8b": 8, "llama3_70b": 64, "llama3_8b_long_context": 32}


@pytest.mark.parametrize("path", sorted(glob.glob(os.path.join(ROOT, "recipes", "*.toml"))))
def test_recipe_validates(path):
    name = os.path.basename(path)[:-5]
    validate(load_config(path), world_size=WORLD.get(name, 1))
