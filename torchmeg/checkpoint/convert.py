"""python -m torchmeg.convert from-hf FOLDER --out DIR [--family auto|hf] [--dtype auto|float32|bfloat16|float16]
                                     [--adapter PEFT_FOLDER]
       python -m torchmeg.convert to-hf CHECKPOINT --config RECIPE --out DIR [--max-shard-gb G] [--section.key=value ...]

from-hf: reads FOLDER/config.json, picks the native family that implements it (llama, incl. Llama 3.1
rope scaling and YaRN; qwen3 as llama with QK norm; qwen3_moe as moe; deepseek_v3 as deepseek_v3, its
MTP modules included where the folder has them) or else `hf` (transformers' own modules), and
writes DIR/recipe.toml describing that model (and FOLDER's tokenizer.json with its config and chat
template, copied) plus, for a
native family, a model-only checkpoint DIR/checkpoint/step-00000000 that training, generation and
evaluation start from (`hf` models read FOLDER's safetensors themselves: checkpoint.initial_load_hf).
Under torchrun each rank converts and writes its own share of the tensors (read one by one from the
safetensors: no rank holds the model). A config field the native family does not implement is
refused in one line naming it. --adapter: a PEFT LoRA adapter of that model (PeftModel.save_pretrained's
folder) goes into the checkpoint beside it and its [lora] keys into the recipe (checkpoint.peft_import).

to-hf: a committed checkpoint (any layout saved it) of RECIPE's model -> DIR/model-0000i-of-0000N
.safetensors + model.safetensors.index.json + config.json, which transformers loads as is. Each
rank reads and writes only its own files' tensors (torchrun: the files are shared out), so nothing
is gathered on one rank.
"""
from __future__ import annotations

import argparse
import functools
import json
import os
import sys

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner

from torchmeg.checkpoint import lora_export, peft_import
from torchmeg.checkpoint.folder import MARKER, commit_folder, committed_steps, file_records, step_dir, tmp_dir
from torchmeg.checkpoint.hf import from_hf_state_dict, hf_names, to_hf_state_dict, torchmeg_fqns
from torchmeg.checkpoint.hf_files import write_safetensors
from torchmeg.checkpoint.hf_export import hf_config
from torchmeg.checkpoint.hf_tokenizer import BESIDE, copy_files, write_generation_files
from torchmeg.checkpoint.hf_quant import FolderReader, header
from torchmeg.checkpoint.hf_config import native_model_keys
from torchmeg.config.errors import ConfigError
from torchmeg.config.schema import load_config
from torchmeg.config.sections import Data
from torchmeg.data.tokenizer import build_tokenizer
from torchmeg.models.args import instantiate, model_args
from torchmeg.models.spec import get_spec
from torchmeg.models.lora import adapted_module, is_adapter
from torchmeg.runtime.guard import cli_main

PROG = "torchmeg.convert"


def _rank_world() -> tuple[int, int]:
    return int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1"))


def _hf_files(folder: str) -> dict[str, str]:
    """HF tensor name -> the safetensors file holding it."""
    index = os.path.join(folder, "model.safetensors.index.json")
    if os.path.isfile(index):
        try:
            with open(index) as fh:
                return {k: os.path.join(folder, f) for k, f in json.load(fh)["weight_map"].items()}
        except (ValueError, KeyError, TypeError, AttributeError) as e:
            raise ConfigError(f"{index}: not a safetensors index (a JSON object whose weight_map maps each tensor to "
                              f"its file: {type(e).__name__}: {e}); download it again") from None
    files = sorted(f for f in os.listdir(folder) if f.endswith(".safetensors"))
    if not files:
        raise ConfigError(f"{folder}: no .safetensors files (and no model.safetensors.index.json)")
    out = {}
    for f in files:
        out.update({k: os.path.join(folder, f) for k in header(os.path.join(folder, f))})
    return out


def _toml_value(v) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, float):
        return repr(v)
    return json.dumps(v) if isinstance(v, (str, list)) else str(v)


def _copy_tokenizer(src: str, out: str) -> None:
    """The folder's tokenizer and what fine-tuning and an export read beside it (its chat template,
    special tokens, generation settings)."""
    copy_files(src, out, ("tokenizer.json",) + BESIDE)


def write_recipe(path: str, name: str, keys: dict, tokenizer: str, checkpoint: str | None, source: str,
                 max_positions: int | None = None, lora: dict | None = None) -> None:
    """The converted model's recipe; `max_positions` (config.json's max_position_embeddings): a context
    shorter than data.seq_len's default sets seq_len to it, so generate, eval and serve take the model as
    written (they refuse a seq_len beyond the model's context)."""
    lines = [f"# written by python -m {PROG} from-hf {source}", "[model]", f'name = "{name}"']
    if name != "hf":
        lines.append('flavor = "debug"  # every field of the model is set below')
    lines += [f"{k} = {_toml_value(v)}" for k, v in keys.items()]
    lines += ["", "[data]", f"tokenizer = {_toml_value(tokenizer)}"]
    if isinstance(max_positions, int) and 2 <= max_positions < Data().seq_len:
        lines.append(f"seq_len = {max_positions}  # the model's context (max_position_embeddings)")
    lines += ["", "[checkpoint]", "enable = true"]
    if checkpoint:
        lines.append(f"folder = {_toml_value(checkpoint)}")
    else:
        lines.append(f"initial_load_hf = {_toml_value(source)}")
    if lora:
        lines += ["", "[lora]  # the PEFT adapter converted beside the model"]
        lines += [f"{k} = {_toml_value(v)}" for k, v in lora.items()]
    with open(path, "w") as fh:
        fh.write("\n".join(lines) + "\n")


def _targets(files: dict, args) -> list[str]:
    """The torchmeg tensors the folder's tensors make (every MTP module the folder holds)."""
    out = set()
    for h in files:
        if "rotary_emb" in h or (args.tie_embeddings and h == "lm_head.weight"):
            continue
        out.update(torchmeg_fqns(h, args))
    return sorted(out)


def _beyond_mtp_depth(fqn: str, args) -> bool:
    return fqn.startswith("mtp.") and int(fqn.split(".")[1]) >= args.n_layers + args.mtp_depth


def _moe_prefixes(args) -> list[str]:
    """The blocks with a routed MoE (main layers after the dense ones; MTP modules' blocks)."""
    main = [f"layers.{i}" for i in range(getattr(args, "n_dense_layers", 0), args.n_layers)]
    return main + [f"mtp.{j}.block" for j in range(args.n_layers, args.n_layers + getattr(args, "mtp_depth", 0))]


def from_hf(a) -> None:
    src, out = os.path.abspath(a.source), os.path.abspath(a.out)
    cfg_path = os.path.join(src, "config.json")
    if not os.path.isfile(cfg_path):
        raise ConfigError(f"{src}: no config.json (a Hugging Face model folder holds config.json + *.safetensors)")
    config = json.load(open(cfg_path))
    native = native_model_keys(config) if a.family == "auto" else None
    rank, world = _rank_world()
    tok = os.path.join(src, "tokenizer.json")
    tokenizer = os.path.join(out, "tokenizer.json") if os.path.isfile(tok) else "byte"
    quant = (config.get("quantization_config") or {}).get("quant_method")
    if native is None and quant:
        raise ConfigError(f"config.json: quantization_config.quant_method = {quant!r}: torchmeg's `hf` family would "
                          f"read the quantized tensors as they are; "
                          + ("use --family auto, whose native family dequantizes them" if a.family == "hf" else
                             f"model_type {config.get('model_type')!r} has no native family to dequantize them into"))
    if native is None and a.adapter:
        raise ConfigError(f"--adapter: {config.get('model_type')!r} has no native family to convert the adapter into; "
                          f"`hf` models load the base only (merge the adapter with PEFT and convert the merged model)")
    if native is None:  # transformers' own modules read the folder themselves
        if rank == 0:
            os.makedirs(out, exist_ok=True)
            _copy_tokenizer(src, out)
            write_recipe(os.path.join(out, "recipe.toml"), "hf", {"hf_config": src}, tokenizer, None, src,
                         config.get("max_position_embeddings"))
            print(f"{config.get('model_type')}: no native family; wrote {out}/recipe.toml (model.name = \"hf\")")
        return
    name, keys = native
    cfg = load_config(None, [f"--model.name={name}"] + [f"--model.{k}={v}" for k, v in keys.items()])
    args = model_args(cfg, None)
    reader = FolderReader(_hf_files(src), config)  # (refuses a quantization it cannot read)
    reader.check()  # every file, tensor and scale grid, before anything is written
    os.makedirs(out, exist_ok=True)
    found = _targets(reader.keys(), args)
    if getattr(args, "mtp_depth", 0) and not any(f.startswith("mtp.") for f in found):
        # (transformers builds no MTP module, so the folders it writes hold none; DeepSeek's own do)
        if rank == 0:
            print(f"config.json: {args.mtp_depth} MTP module(s) but no MTP tensors in {src}: model.mtp_depth = 0 "
                  f"(set it in the recipe to train freshly initialised ones)")
        keys["mtp_depth"] = 0
        cfg = load_config(None, [f"--model.name={name}"] + [f"--model.{k}={v}" for k, v in keys.items()])
        args = model_args(cfg, None)
    args.rope_halves = config.get("rope_interleave", True) is False  # (DeepSeek: see hf._deepseek_rope_from_halves)
    targets = [f for f in found if not _beyond_mtp_depth(f, args)]
    hf_config(args) if hasattr(args, "n_experts") else None  # (a moe outside Qwen3-MoE's shape: refused now)
    ckpt = os.path.join(out, "checkpoint")
    tmp, final = tmp_dir(ckpt, 0), step_dir(ckpt, 0)
    dtype = _dtype(a.dtype, config)
    # This rank's share, streamed: DCP plans the save from each tensor's shape (the model's, on the meta
    # device) and asks for the data one tensor at a time as it writes (_Streaming), one file a tensor
    # (_writer), so a rank holds one converted tensor (and its HF sources) at a time, never its share.
    shapes = {k: v.shape for k, v in instantiate(get_spec(name), args, "meta").state_dict().items()}
    state, loaders = {}, {}
    for fqn in targets[rank::world]:
        names = [fqn] + (["output.weight"] if fqn == "tok_embeddings.weight" and args.tie_embeddings else [])
        for n in names:  # (tied: one tensor in the folder, two names here)
            state[n] = torch.empty(shapes[fqn], dtype=dtype, device="meta")
            loaders[f"model.{n}"] = functools.partial(_convert_one, reader, fqn, args, dtype, shapes[fqn])
    adapter, lora = peft_import.read_adapter(a.adapter, args, shapes) if a.adapter else ({}, None)
    if rank == 0:  # (small: written by one rank)
        state.update(adapter)
    if rank == 0 and hasattr(args, "n_experts"):  # a selection bias the folder lacks starts at 0
        state.update({f"{p}.moe.expert_bias": torch.zeros(args.n_experts) for p in _moe_prefixes(args)
                      if f"{p}.moe.expert_bias" not in targets})
    os.makedirs(tmp, exist_ok=True)
    if world > 1:
        import torch.distributed as dist  # lazy: only a torchrun conversion has a process group
        dist.init_process_group("gloo")
        dcp.save({"model": state}, storage_writer=_writer(tmp), planner=_Streaming(loaders))
        dist.barrier()
    else:
        dcp.save({"model": state}, storage_writer=_writer(tmp), no_dist=True, planner=_Streaming(loaders))
    if rank == 0:
        _copy_tokenizer(src, out)
        meta = {"step": 0, "model_only": True, "model": f"{name}/converted", "source": src,
                "layout": f"converted by {PROG} ({world} process{'es' if world > 1 else ''})",
                "tokenizer": build_tokenizer(tokenizer).fingerprint() if tokenizer != "byte" else ""}
        commit_folder(tmp, final, meta, file_records(tmp, os.listdir(tmp)))
        write_recipe(os.path.join(out, "recipe.toml"), name, keys, tokenizer, ckpt, src,
                     config.get("max_position_embeddings"), lora)
        print(f"{config.get('model_type')} -> native {name}: wrote {final} and {out}/recipe.toml"
              + (f" (with the LoRA adapter of {a.adapter}: {len(adapter) // 2} modules)" if adapter else ""))
    if world > 1:
        dist.barrier()
        dist.destroy_process_group()


def _convert_one(reader: FolderReader, fqn: str, args, dtype: torch.dtype, shape) -> torch.Tensor:
    """torchmeg tensor `fqn` from its HF tensor(s), dequantized where stored quantized."""
    parts = {h: reader.read(h) for h in hf_names(fqn, args)}
    t = from_hf_state_dict(parts, args, tie=False)[fqn].to(dtype).contiguous()
    if t.shape != shape:
        raise ConfigError(f"{fqn}: the folder's {', '.join(parts)} make a {tuple(t.shape)} tensor where config.json "
                          f"describes {tuple(shape)}; the folder's config.json does not match its weights")
    return t


def _writer(folder: str) -> dcp.FileSystemWriter:
    """DCP's file writer, one file per tensor: its writer keeps every tensor of a file until the file is
    closed (torch 2.13, for its safetensors option), so one file per rank would hold the rank's share."""
    return dcp.FileSystemWriter(folder, single_file_per_rank=False)


class _Streaming(DefaultSavePlanner):
    """DCP's save planner with each tensor's data made when the writer reaches it (`loaders`: {state
    key: callable}); the state dict it plans from holds meta tensors of the right shape and dtype."""

    def __init__(self, loaders: dict):
        super().__init__()
        self.loaders = loaders

    def resolve_data(self, write_item):
        load = self.loaders.get(write_item.index.fqn)
        return load() if load is not None else super().resolve_data(write_item)


def _dtype(name: str, config: dict | None = None) -> torch.dtype:
    """--dtype: float32 / bfloat16 / float16, or auto: the folder's config.json `dtype` (`torch_dtype`
    before transformers 5) for from-hf — a bf16 release stays bf16 on disk — and float32 for to-hf."""
    if name == "auto":
        name = str((config or {}).get("dtype") or (config or {}).get("torch_dtype") or "float32")
        if name not in ("float32", "bfloat16", "float16"):
            raise ConfigError(f"config.json dtype {name!r}: torchmeg converts float32, bfloat16 and float16 "
                              f"weights; give --dtype")
    return getattr(torch, name)


def _empty(meta, fqn: str) -> torch.Tensor:
    """A tensor for DCP to load checkpoint tensor `model.<fqn>` into."""
    return torch.empty(tuple(meta[f"model.{fqn}"].size), dtype=meta[f"model.{fqn}"].properties.dtype)


def to_hf(a, overrides: list[str]) -> None:
    cfg = load_config(a.config, overrides)
    dtype = _dtype(a.dtype)
    if cfg.model.name not in ("llama", "moe", "deepseek_v3", "gpt_oss"):
        raise ConfigError(f"model.name = {cfg.model.name!r}: to-hf writes the native llama, moe, deepseek_v3 and "
                          f"gpt_oss families (Llama, Qwen3, Qwen3-MoE, DeepSeek-V3, gpt-oss); `hf` models export as "
                          f"they are with checkpoint.export_hf")
    tokenizer = build_tokenizer(cfg.data.tokenizer)
    args = model_args(cfg, tokenizer.vocab_size)
    path = os.path.abspath(a.source)
    if not os.path.isfile(os.path.join(path, MARKER)):
        steps = committed_steps(path)
        if not steps:
            raise ConfigError(f"{path}: not a committed checkpoint (no {MARKER}) nor a folder of them")
        path = step_dir(path, steps[-1])
    config = hf_config(args)  # (refuses a model transformers has no class for, before any work)
    meta = dcp.FileSystemReader(path).read_metadata().state_dict_metadata
    keep_bias = hasattr(args, "kv_lora_rank")  # DeepSeek-V3 stores the selection bias; Qwen3-MoE has none
    fqns = sorted((k[len("model."):] for k in meta if k.startswith("model.") and (keep_bias or not k.endswith("expert_bias"))),
                  key=lambda f: f.replace("experts.w3", "experts.w1+").replace("experts.b3", "experts.b1+"))
    if args.tie_embeddings:
        fqns = [f for f in fqns if f != "output.weight"]
    adapters = [f for f in fqns if is_adapter(f)]  # LoRA: merged into their bases, or a PEFT folder beside them
    fqns = [f for f in fqns if not is_adapter(f)]
    if adapters and not cfg.lora.enable:
        raise ConfigError(f"{path} holds LoRA adapters: give the recipe they were trained with (lora.enable = true, "
                          f"its lora.rank and lora.alpha)")
    scale = lora_export.scaling(cfg.lora)
    # Files of about max_shard_gb each, in FQN order; rank r writes files r, r + world, ...
    limit, files, size = a.max_shard_gb * 2 ** 30, [[]], 0
    for f in fqns:
        n = meta[f"model.{f}"].size.numel() * torch.finfo(dtype).bits // 8
        # (gpt-oss's gate and up, adjacent in this order, make one HF tensor: one file)
        shared = bool(files[-1]) and bool(set(hf_names(files[-1][-1], args)) & set(hf_names(f, args)))
        if files[-1] and size + n > limit and not shared:
            files.append([])
            size = 0
        files[-1].append(f)
        size += n
    rank, world = _rank_world()
    out, count = os.path.abspath(a.out), len(files)
    os.makedirs(out, exist_ok=True)
    names = [f"model-{i + 1:05d}-of-{count:05d}.safetensors" for i in range(count)]
    weight_map = {}
    for i, group in enumerate(files):
        sd = {f: _empty(meta, f) for f in group}
        weight_map.update({h: names[i] for f in group for h in hf_names(f, args)})
        if i % world != rank:
            continue
        if a.merge_lora:
            sd.update({f: _empty(meta, f) for f in adapters if adapted_module(f) + ".weight" in sd})
        dcp.load({"model": sd}, checkpoint_id=path, no_dist=True)
        if a.merge_lora:
            base, pairs = lora_export.split(sd)
            sd = lora_export.merge(base, pairs, scale)
        tensors = {h: t.to(dtype).contiguous() for h, t in to_hf_state_dict(sd, args).items()}
        write_safetensors(tensors, out, names[i])
    if rank == 0:
        total = sum(meta[f"model.{f}"].size.numel() for f in fqns) * torch.finfo(dtype).bits // 8
        with open(os.path.join(out, "model.safetensors.index.json"), "w") as fh:
            json.dump({"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}, fh, indent=1)
        config["torch_dtype"] = str(dtype).replace("torch.", "")
        with open(os.path.join(out, "config.json"), "w") as fh:
            json.dump(config, fh, indent=1)
        write_generation_files(cfg, tokenizer, out)
        print(f"wrote {out}: {count} safetensors file(s), index, config.json ({config['architectures'][0]}), "
              f"the tokenizer, generation_config.json"
              + (f"; {len(adapters) // 2} LoRA adapters merged" if adapters and a.merge_lora else ""))
        if adapters and not a.merge_lora:
            sd = {f: _empty(meta, f) for f in adapters}
            dcp.load({"model": sd}, checkpoint_id=path, no_dist=True)
            folder = os.path.join(out, lora_export.ADAPTER_DIR)
            lora_export.save_peft(lora_export.split(sd)[1], args, cfg.lora, folder, False, out, dtype)
            print(f"wrote {folder}: {len(adapters) // 2} LoRA adapters in PEFT's format "
                  f"(PeftModel.from_pretrained(base, '{folder}'); --merge-lora merges them instead)")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog=f"python -m {PROG}", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("direction", choices=["from-hf", "to-hf"])
    ap.add_argument("source")
    ap.add_argument("--out", required=True)
    ap.add_argument("--config", default=None, help="to-hf: the recipe the checkpoint was trained with")
    ap.add_argument("--family", default="auto", choices=["auto", "hf"], help="from-hf: hf = transformers' modules")
    ap.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"],
                    help="from-hf: auto = the folder's config.json dtype; to-hf: auto = float32")
    ap.add_argument("--max-shard-gb", type=float, default=5.0, help="to-hf: size of each safetensors file")
    ap.add_argument("--adapter", default=None, help="from-hf: a PEFT LoRA adapter folder of the model, converted "
                                                     "beside it")
    ap.add_argument("--merge-lora", action="store_true", help="to-hf: LoRA adapters merged into the weights "
                                                               "(default: a PEFT adapter folder beside them)")
    a, overrides = ap.parse_known_args(sys.argv[1:] if argv is None else argv)

    def prepare():
        if a.direction == "to-hf" and not a.config:
            raise ConfigError("to-hf needs --config RECIPE (the recipe the checkpoint was trained with)")
        if not os.path.exists(a.source):
            raise ConfigError(f"{a.source}: no such folder")
        return a

    def run(_):
        from_hf(a) if a.direction == "from-hf" else to_hf(a, overrides)
    return cli_main(PROG, prepare, run)
