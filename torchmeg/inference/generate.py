"""python -m torchmeg.generate --config RECIPE [--section.key=value ...] --prompt TEXT [--prompt TEXT ...]
       [--prompts-file F] [--max-new-tokens N] [--temperature T] [--top-k K] [--top-p P] [--min-p P]
       [--repetition-penalty R] [--generation-config auto|vllm] [--seed S] [--num-samples N]
       [--batch-size B] [--no-cache] [--ignore-eos] [--json] [--chat]

Samples text from the recipe's trained model: the newest committed checkpoint of its run
(--checkpoint.load_step=N for another; --checkpoint.folder=DIR for another run's), whatever layout
saved it, or Hugging Face weights for `hf` models (checkpoint.initial_load_hf, or a model.hf_config
folder holding safetensors). One process, or under torchrun tensor parallel over every launched
process (the model's own TP plan; every rank samples the same token). With --compile.enable=true
the decode step is compiled once, over a static KV cache.

Sampling as vLLM's `LLM.generate` takes it: what the command line leaves out comes from the model's
generation_config.json (beside its tokenizer; a converted release's), else greedy (temperature 0),
128 new tokens, no top-k / top-p / min-p or repetition penalty; --generation-config vllm ignores the
file. Temperature, min-p, top-k and top-p (vLLM's order), after the repetition penalty; seeded: a
prompt's text depends only on (seed, prompt, sample number), alone or in a batch. --prompts-file: one prompt
per line, or JSON lines with a "prompt" field (.jsonl). An empty prompt starts a new document.
"""
from __future__ import annotations

import argparse
import json
import os
import sys

import torch
import torch.distributed as dist

from torchmeg.runtime import guard
from torchmeg.runtime import process as runtime
from torchmeg.parallel.compile import setup as compile_setup
from torchmeg.config.schema import load_config
from torchmeg.data.chat import chat_template
from torchmeg.data.tokenizer import build_tokenizer
from torchmeg.config.errors import ConfigError
from torchmeg.batching.generation import Sampling, decode_one, generate
from torchmeg.inference.kv_replicas import replicate_kv_heads
from torchmeg.inference.sampling_defaults import sampling_defaults
from torchmeg.inference.trained import load_trained
from torchmeg.train.validate import validate

PROG = "torchmeg.generate"


def parse(argv: list[str]):
    ap = argparse.ArgumentParser(prog=f"python -m {PROG}", description=__doc__.split("\n\n")[1],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", required=True, help="the recipe the model was trained with")
    ap.add_argument("--prompt", action="append", default=[], help="a prompt (repeat for several)")
    ap.add_argument("--prompts-file", default=None, help="prompts, one per line (or JSON lines: .jsonl)")
    ap.add_argument("--max-new-tokens", type=int, default=None, help="default: the model's, else 128")
    ap.add_argument("--temperature", type=float, default=None, help="0 = greedy (default: the model's, else 0)")
    ap.add_argument("--top-k", type=int, default=None, help="0 = off (default: the model's, else off)")
    ap.add_argument("--top-p", type=float, default=None, help="1 = off (default: the model's, else off)")
    ap.add_argument("--min-p", type=float, default=None, help="0 = off (default: the model's, else off)")
    ap.add_argument("--repetition-penalty", type=float, default=None, help="1 = off (default: the model's, else off)")
    ap.add_argument("--generation-config", default="auto", choices=["auto", "vllm"],
                    help="auto (vLLM's default): the model's generation_config.json sets what is left out; vllm: "
                    "the defaults above")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--num-samples", type=int, default=1, help="samples per prompt")
    ap.add_argument("--batch-size", type=int, default=0, help="prompts run together (0 = all)")
    ap.add_argument("--no-cache", action="store_true", help="recompute the whole sequence per token (slow)")
    ap.add_argument("--ignore-eos", action="store_true", help="always max-new-tokens tokens (benchmarks, comparisons)")
    ap.add_argument("--json", action="store_true", help="one JSON object per prompt and sample")
    ap.add_argument("--chat", action="store_true", help="each prompt is a user message, rendered with the recipe's "
                    "chat template (data.chat_template or the tokenizer's); the answer ends at the turn's end")
    return ap.parse_known_args(argv)


def inference_config(cfg, world: int):
    """The layout a trained model runs in for generation: tensor parallel over every process and
    nothing else of the training recipe (no FSDP, PP, CP, recompute, float8, per-block compile;
    logits gathered; fp32 weights as the checkpoint holds them)."""
    p = cfg.parallelism
    p.tensor_parallel_degree = world
    p.data_parallel_shard_degree = p.data_parallel_replicate_degree = p.pipeline_parallel_degree = 1
    p.context_parallel_degree = p.expert_parallel_degree = 1
    p.sequence_parallel = p.loss_parallel = p.enable_async_tensor_parallel = False
    cfg.activation_checkpoint.mode, cfg.float8.enable, cfg.compile.enable = "none", False, False
    cfg.training.mixed_precision = "fp32"
    return cfg


def read_prompts(a) -> list[str]:
    prompts = list(a.prompt)
    if a.prompts_file:
        if not os.path.isfile(a.prompts_file):
            raise ConfigError(f"--prompts-file {a.prompts_file!r}: no such file")
        with open(a.prompts_file, encoding="utf-8") as fh:
            lines = [line.rstrip("\n") for line in fh if line.strip()]
        if a.prompts_file.endswith(".jsonl"):
            try:
                rows = [json.loads(line) for line in lines]
                prompts += [r["prompt"] if isinstance(r, dict) else str(r) for r in rows]
            except (ValueError, KeyError, TypeError) as e:
                raise ConfigError(f"--prompts-file {a.prompts_file!r}: not JSON lines with a \"prompt\" field "
                                  f"({type(e).__name__}: {e})") from None
        else:
            prompts += lines
    if not prompts:
        raise ConfigError("no prompt: give --prompt TEXT (repeatable) or --prompts-file F")
    return prompts


def check(a, prompt_ids: list[list[int]], max_len: int) -> None:
    if a.max_new_tokens < 1:
        raise ConfigError(f"--max-new-tokens {a.max_new_tokens}: must be >= 1")
    if a.num_samples < 1 or a.batch_size < 0:
        raise ConfigError(f"--num-samples {a.num_samples} / --batch-size {a.batch_size}: must be >= 1 / >= 0")
    for i, ids in enumerate(prompt_ids):
        if len(ids) >= max_len:
            raise ConfigError(f"--prompt #{i + 1}: {len(ids)} tokens, but the model's max_seq_len is {max_len}; "
                              f"shorten it")
        if len(ids) + a.max_new_tokens > max_len:
            raise ConfigError(f"--max-new-tokens {a.max_new_tokens}: prompt #{i + 1} ({len(ids)} tokens) + "
                              f"{a.max_new_tokens} new ones exceed the model's max_seq_len {max_len}; lower it")


# flag -> (generation_config.json's field as sampling_defaults names it, the default without one)
DEFAULTS = {"temperature": ("temperature", 0.0), "top_k": ("top_k", 0), "top_p": ("top_p", 1.0), "min_p": ("min_p", 0.0),
            "repetition_penalty": ("repetition_penalty", 1.0), "max_new_tokens": ("max_tokens", 128)}


def resolve_sampling(a, tok) -> Sampling:
    """The flags left out take the model's generation_config.json values (vLLM's `auto`), else the
    defaults above; a.note says which the file set (for the header line)."""
    from_file, _ = sampling_defaults(tok, a.generation_config)
    taken = []
    for flag, (field, default) in DEFAULTS.items():
        if getattr(a, flag) is None:
            setattr(a, flag, from_file.get(field, default))
            taken += [f"{flag} {from_file[field]}"] if field in from_file else []
    a.note = "from the model's generation_config.json: " + ", ".join(taken) if taken else ""
    if not 0 < a.repetition_penalty <= 2:
        raise ConfigError(f"--repetition-penalty {a.repetition_penalty}: must be in (0, 2] (1 = off)")
    sampling = Sampling(a.temperature, a.top_k, a.top_p, a.seed, a.min_p)
    sampling.check()
    return sampling


def prepare(argv: list[str]):
    a, rest = parse(argv)
    cfg = load_config(a.config, rest)
    compile_decode = cfg.compile.enable
    world = int(os.environ.get("WORLD_SIZE", "1"))
    a.kv_copies = replicate_kv_heads(cfg, world)
    layout = validate(inference_config(cfg, world), world, data=False)
    tok = build_tokenizer(cfg.data.tokenizer)
    sampling = resolve_sampling(a, tok)
    texts = read_prompts(a)
    a.stop, a.stop_id = "", None
    if a.chat:  # a fine-tuned model: the template's prompt, stopped at its end-of-turn
        template = chat_template(cfg)
        texts = [template.render([{"role": "user", "content": t}], add_generation_prompt=True) for t in texts]
        a.stop, a.stop_id = template.end_of_turn(tok)  # one token (HF templates): decoding stops there
    # A prompt is encoded as the tokenizer is configured (its post-processor's BOS: what transformers'
    # `tokenizer(text)` and vLLM's completions give); a rendered chat already holds the template's own.
    encode = tok.encode if a.chat else tok.encode_with_specials
    ids = [encode(t) or [tok.eos_id] for t in texts]  # an empty prompt starts a new document
    check(a, ids, layout.args.max_seq_len)
    return a, cfg, layout, sampling, compile_decode, texts, ids


def run(prepared) -> None:
    a, cfg, layout, sampling, compile_decode, texts, ids = prepared
    loaded = load_trained(cfg, layout, logits=True, kv_copies=a.kv_copies)
    tok, rank = loaded.tokenizer, dist.get_rank()
    step = None
    if compile_decode:
        compile_setup(cfg.compile.cache_dir)
        step = torch.compile(decode_one, dynamic=False)
    if rank == 0 and not a.json:
        kv = f" (KV heads x{a.kv_copies})" if a.kv_copies > 1 else ""
        print(f"{PROG}: {cfg.model.name}/{cfg.model.flavor} from {loaded.source} | {layout.dims.describe()}{kv} | "
              f"{'compiled' if step else 'eager'} decode{'' if not a.no_cache else ' without KV cache'}"
              + (f" | sampling defaults {a.note}" if a.note else ""),
              file=sys.stderr, flush=True)
    size = a.batch_size or len(ids)
    for sample_index in range(a.num_samples):
        for start in range(0, len(ids), size):
            batch = ids[start:start + size]
            # The end of text, a release's generation_config.json ends, and the template's end of turn.
            eos = () if a.ignore_eos else tok.end_ids | ({a.stop_id} if a.stop_id is not None else set())
            out = generate(loaded.built.model, batch, a.max_new_tokens, eos, sampling, loaded.device,
                           use_cache=not a.no_cache, decode_step=step, sample_index=sample_index,
                           repetition_penalty=a.repetition_penalty)
            if rank == 0:
                for i, g in enumerate(out):
                    _print(a, texts[start + i], start + i, sample_index, g, tok, loaded, layout)
    loaded = None
    runtime.end()


def _print(a, text: str, index: int, sample_index: int, g, tok, loaded, layout) -> None:
    new = tok.decode(g.tokens)
    if a.stop and a.stop in new:  # --chat with a multi-token end of turn: the answer is what comes before it
        new = new[:new.index(a.stop)]
    if a.json:
        print(json.dumps({"prompt": text, "sample": sample_index, "prompt_tokens": g.prompt_tokens,
                          "tokens": g.tokens, "text": new, "finish_reason": g.finish_reason,
                          "prefill_ms": round(g.prefill_ms, 3),
                          "decode_tokens_per_sec": round(g.decode_tokens_per_sec, 2),
                          "weights": loaded.source, "step": loaded.step, "layout": layout.dims.describe()}),
              flush=True)
        return
    print(f"--- prompt {index + 1}" + (f", sample {sample_index + 1}" if a.num_samples > 1 else "")
          + f": {len(g.tokens)} new tokens ({g.finish_reason}), prefill {g.prefill_ms:.1f} ms, "
          f"{g.decode_tokens_per_sec:,.0f} tokens/s", flush=True)
    print(text + new, flush=True)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    return guard.cli_main(PROG, lambda: prepare(argv), run)
