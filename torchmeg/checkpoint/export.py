"""A trained model written for transformers at the end of a run (checkpoint.export_hf): gathered on
rank 0, in transformers' names and layout (checkpoint.hf); LoRA adapters merged into the weights
(lora.merge_on_export) or beside them in PEFT's format (checkpoint.lora_export); the run's tokenizer,
special ids and generation_config.json beside them (checkpoint.hf_tokenizer)."""
from __future__ import annotations

import os

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

from torchmeg.checkpoint import lora_export
from torchmeg.checkpoint.hf_files import save_hf, save_hf_native
from torchmeg.checkpoint.hf_tokenizer import write_generation_files
from torchmeg.data.tokenizer import build_tokenizer


def export_hf(model, args, cfg, folder: str) -> None:
    """Gather the full model on rank 0 and write it as an HF folder (LlamaForCausalLM for `llama`,
    the model's own class for `hf`)."""
    name = cfg.model.name
    if name not in ("llama", "hf"):
        raise ValueError("checkpoint.export_hf supports model.name = 'llama' and 'hf'")
    sd = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    if dist.get_rank() == 0:
        dtype = getattr(torch, cfg.checkpoint.export_dtype)
        sd, pairs = lora_export.split(sd)
        if pairs and cfg.lora.merge_on_export:
            sd = lora_export.merge(sd, pairs, lora_export.scaling(cfg.lora))
        (save_hf if name == "llama" else save_hf_native)(sd, args, folder, dtype)
        write_generation_files(cfg, build_tokenizer(cfg.data.tokenizer), folder)  # a folder that stands alone
        print(f"[checkpoint] HF safetensors written to {folder}" + (" (LoRA merged)" if pairs and cfg.lora.merge_on_export
                                                                    else ""), flush=True)
        if pairs and not cfg.lora.merge_on_export:
            adapter = os.path.join(folder, lora_export.ADAPTER_DIR)
            lora_export.save_peft(pairs, args, cfg.lora, adapter, name == "hf", folder, dtype)
            print(f"[checkpoint] LoRA adapters in PEFT's format written to {adapter}", flush=True)
    dist.barrier()
