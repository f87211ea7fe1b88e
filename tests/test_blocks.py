"""Blocks found wherever a model keeps them, and parallelize() never silent about what it did."""
import os
import re
import subprocess
import sys

import pytest
import torch
from torch import nn

from conftest import FP32_PARITY
from launch import ROOT
from torchmeg.models.blocks import blocks, find_blocks


def _nanogpt():
    sys.path.insert(0, os.path.join(ROOT, "examples"))
    try:
        from nanogpt import GPT
    finally:
        sys.path.pop(0)
    return GPT(n_layer=3)


def _hf_llama():
    from transformers import LlamaConfig, LlamaForCausalLM
    cfg = LlamaConfig(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=3,
                      num_attention_heads=4, num_key_value_heads=2)
    with torch.device("meta"):
        return LlamaForCausalLM(cfg)


def _torchmeg_llama():
    from torchmeg.config.schema import load_config
    from torchmeg.models import build_model
    return build_model(load_config(None, ["--model.n_layers=3"]), 257, "meta")


@pytest.mark.parametrize("build, path", [(_torchmeg_llama, "layers"), (_nanogpt, "transformer.h"),
                                         (_hf_llama, "model.layers")])
def test_blocks_are_found_wherever_they_are(build, path):
    model = build()
    assert find_blocks(model)[0] == path
    assert len(blocks(model)) == 3


def test_blocks_can_be_named_and_bad_names_are_refused():
    model = _nanogpt()
    assert find_blocks(model, "transformer.h")[0] == "transformer.h"
    with pytest.raises(ValueError, match="'transformer.nope': the model has no submodule"):
        find_blocks(model, "transformer.nope")
    with pytest.raises(ValueError, match="'lm_head' is a Linear, not a ModuleList"):
        find_blocks(model, "lm_head")


def test_no_blocks_with_compile_or_recompute_is_one_clear_error():
    from torchmeg.parallel.compile import compile_blocks
    from torchmeg.config.schema import load_config
    from torchmeg.parallel.recompute import apply_recompute
    flat = nn.Module()  # nothing repeated
    flat.up, flat.down = nn.Linear(8, 32), nn.Linear(32, 8)
    assert find_blocks(flat) == ("", None)
    with pytest.raises(ValueError, match="compile.enable = true: no blocks found.*model.blocks"):
        compile_blocks(flat)
    cfg = load_config(None, ["--activation_checkpoint.mode=full"])
    with pytest.raises(ValueError, match="activation_checkpoint.mode = 'full': no blocks found.*model.blocks"):
        apply_recompute(flat, cfg.activation_checkpoint)


def test_tp_plan_matches_are_counted_and_an_unmatched_pattern_is_named():
    from torchmeg.parallel.tensor import expand_plan, unmatched_patterns
    model = _torchmeg_llama()
    matched = {}
    expand_plan(model, [("layers.*.attention.wq", "colwise"), ("layers.*.nope", "colwise")], sp=False,
                loss_parallel=False, matched=matched)
    assert matched == {"layers.*.attention.wq": 3, "layers.*.nope": 0}
    with pytest.raises(ValueError, match="TP plan entry 'layers.\\*.nope' matches no module"):
        unmatched_patterns(matched, strict=True)


@pytest.mark.slow
def test_nanogpt_example_fsdp_compile_recompute_matches_one_process():
    p = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
                        os.path.join(ROOT, "examples", "nanogpt.py")],
                       capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert p.returncode == 0, p.stderr[-3000:]
    assert "blocks transformer.h, FSDP units 4, compiled 3, recompute 3" in p.stdout, p.stdout
    diff = float(re.search(r"max relative loss diff vs one process over 3 steps = (\S+)", p.stdout).group(1))
    assert diff < FP32_PARITY  # conftest's rule
