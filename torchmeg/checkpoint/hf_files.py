"""Hugging Face folders on disk: safetensors written whole or not at all, a native model saved or read
in transformers' names (hf.py maps them), an `hf` model's own folder, and checkpoint.initial_load_hf
(each rank reading its shards through DCP's HuggingFaceStorageReader).
"""
from __future__ import annotations

import json
import os

import torch
import torch.distributed.checkpoint as dcp
from safetensors.torch import load_file, save_file
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict, set_model_state_dict

from torchmeg.checkpoint.hf import from_hf_state_dict, to_hf_state_dict
from torchmeg.checkpoint.hf_export import hf_config
from torchmeg.checkpoint.manager import all_finite
from torchmeg.config.errors import ConfigError
from torchmeg.models.lora import is_adapter


def save_hf(sd: dict, args, folder: str, dtype: torch.dtype = torch.float32) -> None:
    hf = {k: v.detach().to("cpu", dtype) for k, v in to_hf_state_dict(sd, args).items()}
    write_safetensors(hf, folder)
    cfg = hf_config(args)
    cfg["torch_dtype"] = str(dtype).replace("torch.", "")
    with open(os.path.join(folder, "config.json"), "w") as fh:
        json.dump(cfg, fh, indent=1)


def write_safetensors(tensors: dict, folder: str, name: str = "model.safetensors") -> None:
    """folder/name, written whole or not at all (a temporary file, then a rename)."""
    os.makedirs(folder, exist_ok=True)
    tmp = os.path.join(folder, name + ".tmp")
    save_file(tensors, tmp, metadata={"format": "pt"})
    os.replace(tmp, os.path.join(folder, name))


def load_hf(folder: str, args) -> dict:
    """torchmeg state dict from an HF folder (model.safetensors or sharded model-*.safetensors)."""
    files = sorted(f for f in os.listdir(folder) if f.endswith(".safetensors"))
    if not files:
        raise FileNotFoundError(f"{folder}: no .safetensors files")
    sd = {}
    for f in files:
        sd.update(load_file(os.path.join(folder, f)))
    return from_hf_state_dict(sd, args)


def save_hf_native(sd: dict, args, folder: str, dtype: torch.dtype = torch.float32) -> None:
    """A model.name = 'hf' state dict (already in HF names) + its config, as transformers saves them:
    loads with AutoModelForCausalLM.from_pretrained(folder). A tied LM head is stored once."""
    write_safetensors({k: v.detach().to("cpu", dtype).contiguous() for k, v in sd.items()
                        if not (args.tie_embeddings and k == "lm_head.weight")}, folder)
    config = args.config
    config.dtype = str(dtype).replace("torch.", "")  # (transformers 5 name; was torch_dtype)
    config.to_json_file(os.path.join(folder, "config.json"))


def load_hf_native(model, folder: str) -> int:
    """Load an HF safetensors folder into a (parallelized, materialised) model.name = 'hf' model.
    DCP's HuggingFaceStorageReader plans the reads: each rank reads only the slices of its own
    shards (FSDP / TP DTensors). Returns the number of tensors loaded."""
    sd = {k: v for k, v in get_model_state_dict(model).items() if not is_adapter(k)}  # (LoRA: the base's only)
    if getattr(model, "args", None) is not None and model.args.tie_embeddings:
        sd.pop("lm_head.weight", None)  # stored once, under the embedding's name
    dcp.load(sd, storage_reader=dcp.HuggingFaceStorageReader(folder))
    # Not strict: under LoRA the model also holds its adapters, which keep their own initialisation
    # (B = 0: the run starts as the folder's model); anything else missing is still an error.
    result = set_model_state_dict(model, sd, options=StateDictOptions(strict=False))
    missing = [k for k in result.missing_keys if not is_adapter(k)]
    if missing or result.unexpected_keys:
        raise RuntimeError(f"missing {missing[:3]}, unexpected {list(result.unexpected_keys)[:3]}")
    return len(sd)


def check_initial_load(cfg, hf_native: bool) -> None:
    """checkpoint.initial_load_hf: a model whose parameters carry HF names, and a folder of safetensors."""
    folder = cfg.checkpoint.initial_load_hf
    if not folder:
        return
    if not hf_native:
        raise ConfigError(f"checkpoint.initial_load_hf: for model.name = 'hf'; convert weights for "
                          f"{cfg.model.name!r} with tools/convert_hf.py")
    if not os.path.isdir(folder) or not any(f.endswith(".safetensors") for f in os.listdir(folder)):
        raise ConfigError(f"checkpoint.initial_load_hf = {folder!r}: not a directory holding .safetensors files")


def load_initial_hf(model, whole, folder: str) -> str:
    """checkpoint.initial_load_hf: a fresh run starts from Hugging Face safetensors (each rank reads its
    shards only); the weights must be finite, like a resumed checkpoint's. -> the header's init note."""
    model_class = getattr(whole, "hf_class", type(whole).__name__)
    try:
        n = load_hf_native(model, folder)
    except Exception as e:  # noqa: BLE001 - DCP wraps per-rank errors; one line names the folder
        msg = str(e).strip().splitlines()
        raise ConfigError(f"checkpoint.initial_load_hf = {folder!r}: cannot load it into "
                          f"{model_class} ({msg[-1] if msg else type(e).__name__})") from None
    if not all_finite(model.parameters()):  # all-reduced: every rank stops alike
        raise ConfigError(f"checkpoint.initial_load_hf = {folder!r}: non-finite values in the weights")
    return f"from Hugging Face weights in {folder} ({n} tensors)"
