"""The README's public-API example: a user's own model and plan, TP2 and TP2 x FSDP2."""
import os
import re
import subprocess
import sys

import pytest

from conftest import FP32_PARITY
from launch import ROOT


@pytest.mark.slow
@pytest.mark.parametrize("ranks", [2, 4])
def test_custom_model_example_matches_one_process(ranks):
    p = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={ranks}",
                        os.path.join(ROOT, "examples", "custom_model.py")],
                       capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert p.returncode == 0, p.stderr[-3000:]
    diff = float(re.search(r"max relative diff vs one process = (\S+)", p.stdout).group(1))
    assert diff < FP32_PARITY  # conftest's rule
