#!/usr/bin/env python
"""Llama weights between HuggingFace safetensors and torchmeg checkpoints.

  # HF folder -> a model-only torchmeg checkpoint that training starts from (step 0):
  python tools/convert_hf.py from-hf /path/to/hf_llama --config recipes/X.toml
  # a committed torchmeg checkpoint -> HF folder (model.safetensors + config.json):
  python tools/convert_hf.py to-hf outputs/run/checkpoint/step-00000200 --config recipes/X.toml --out hf_out

The recipe (and --model.* overrides) gives the model shape; checkpoint.folder says where from-hf writes.
"""
from __future__ import annotations

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("direction", choices=["from-hf", "to-hf"])
    ap.add_argument("source")
    ap.add_argument("--config", required=True)
    ap.add_argument("--out", default=None, help="to-hf: output folder")
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    a, overrides = ap.parse_known_args(argv)

    import torch
    import torch.distributed.checkpoint as dcp
    from torchmeg.checkpoint.manager import MARKER, resolve_folder, step_dir
    from torchmeg.config.schema import load_config
    from torchmeg.data.tokenizer import build_tokenizer
    from torchmeg.checkpoint.hf import load_hf, save_hf
    from torchmeg.models import build_model

    cfg = load_config(a.config, overrides)
    model = build_model(cfg, build_tokenizer(cfg.data.tokenizer).vocab_size, "cpu")
    if a.direction == "from-hf":
        sd = load_hf(a.source, model.args)
        model.load_state_dict(sd, strict=True)
        out = step_dir(resolve_folder(cfg), 0)
        dcp.save({"model": model.state_dict()}, checkpoint_id=out, no_dist=True)
        with open(os.path.join(out, MARKER), "w") as fh:
            json.dump({"step": 0, "model_only": True, "source": os.path.abspath(a.source)}, fh)
        print(f"wrote {out}: training with this recipe and checkpoint.enable = true starts from these weights")
    else:
        if not a.out:
            ap.error("to-hf needs --out")
        state = {"model": model.state_dict()}
        dcp.load(state, checkpoint_id=a.source, no_dist=True)
        save_hf(state["model"], model.args, a.out, getattr(torch, a.dtype))
        print(f"wrote {a.out}/model.safetensors and config.json")
    return 0


if __name__ == "__main__":
    sys.exit(main())
