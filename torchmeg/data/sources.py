"""Where tokens come from: the built-in `python_stdlib` corpus or .bin/.idx stores on disk."""
from __future__ import annotations

import os
import sys
import sysconfig

import numpy as np

from torchmeg.data import store as store_mod
from torchmeg.data.tokenizer import build_tokenizer
from torchmeg.config.errors import ConfigError, StoreError

BUILTIN = ("python_stdlib",)
BUILTIN_CHAT = "python_stdlib_chat"  # sft's built-in conversations (torchmeg.data.chat_data)
BUILTIN_PAIRS = "python_stdlib_pairs"  # dpo's built-in preference pairs (torchmeg.data.pairs)
BUILTIN_PROMPTS = "python_stdlib_names"  # grpo's built-in prompts (torchmeg.data.name_task)
_SKIP_DIRS = {"site-packages", "dist-packages", "test", "tests", "idle_test", "__pycache__"}


def cache_dir(cfg=None) -> str:
    d = (cfg.data.cache_dir if cfg is not None else "") or os.environ.get("TORCHMEG_CACHE") \
        or os.path.join(os.path.expanduser("~"), ".cache", "torchmeg")
    os.makedirs(d, exist_ok=True)
    return d


def stdlib_files() -> list[str]:
    """The standard library's own .py sources, tests and installed packages excluded, sorted."""
    root = sysconfig.get_paths()["stdlib"]
    out = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if d not in _SKIP_DIRS and not d.startswith("config-"))
        out += [os.path.join(dirpath, f) for f in sorted(filenames) if f.endswith(".py")]
    return out


def stdlib_prefix(tokenizer, cfg) -> str:
    tag = f"py{sys.version_info.major}{sys.version_info.minor}"
    return os.path.join(cache_dir(cfg), f"python_stdlib-{tag}-{tokenizer.fingerprint()}-megatron")


def build_stdlib(tokenizer, cfg=None) -> str:
    """Tokenize the stdlib once into the cache (atomic; concurrent builders are harmless)."""
    prefix = stdlib_prefix(tokenizer, cfg)
    if store_mod.exists(prefix):
        return prefix
    writer = store_mod.make_writer(prefix + f".{os.getpid()}", tokenizer.vocab_size)
    files = stdlib_files()
    for i in range(0, len(files), 256):
        texts = []
        for path in files[i:i + 256]:
            with open(path, encoding="utf-8", errors="replace") as fh:
                texts.append(fh.read())
        docs = tokenizer.encode_batch(texts) if hasattr(tokenizer, "encode_batch") else [tokenizer.encode_np(t) for t in texts]
        for d in docs:
            writer.add(np.append(np.asarray(d, dtype=np.int64), tokenizer.eos_id))
    writer.close()
    for ext in (".bin", ".idx"):  # publish under the shared name; .idx last so readers see a whole store
        os.replace(writer.prefix + ext, prefix + ext)
    return prefix


def resolve(name: str, tokenizer, cfg=None) -> str:
    """A dataset entry -> store prefix (building the built-in corpus if needed)."""
    if name in BUILTIN:
        return build_stdlib(tokenizer, cfg)
    for ext in (".bin", ".idx"):
        if name.endswith(ext):
            name = name[: -len(ext)]
    return name


def dataset_list(cfg) -> list[str]:
    ds = cfg.data.dataset
    return list(ds) if isinstance(ds, list) else [ds]


def check_data_config(cfg) -> None:
    """Every dataset exists and matches the tokenizer; blend weights are consistent."""
    tok = build_tokenizer(cfg.data.tokenizer)
    names = dataset_list(cfg)
    if not names or not all(isinstance(n, str) and n for n in names):
        raise ConfigError(f"data.dataset = {cfg.data.dataset!r}: give \"python_stdlib\", a .bin/.idx prefix, or a list of them")
    objective = cfg.training.objective
    if objective == "grpo":
        for n in names:
            if n != BUILTIN_PROMPTS and not (n.endswith((".jsonl", ".json", ".parquet")) and os.path.isfile(n)):
                raise ConfigError(f"data.dataset = {n!r}: training.objective = \"grpo\" reads prompts (.jsonl or "
                                  f".parquet of {{\"prompt\": ...}} or {{\"messages\": [...]}}, other keys handed to the "
                                  f"reward functions) or \"{BUILTIN_PROMPTS}\"; no such file")
        if cfg.data.weights:
            raise ConfigError("data.weights: grpo reads its prompt files in full; leave weights empty")
        return
    if objective in ("sft", "dpo"):
        builtin, what = ((BUILTIN_CHAT, "chat files (.jsonl or .parquet of {\"messages\": [...]})") if objective == "sft"
                         else (BUILTIN_PAIRS, "preference pairs (.jsonl or .parquet of {\"prompt\", \"chosen\", "
                                              "\"rejected\"})"))
        for n in names:
            if n != builtin and not (n.endswith((".jsonl", ".json", ".parquet")) and os.path.isfile(n)):
                raise ConfigError(f"data.dataset = {n!r}: training.objective = \"{objective}\" reads {what} or "
                                  f"\"{builtin}\"; no such file")
        if cfg.data.weights:
            raise ConfigError(f"data.weights: {objective} reads its files in full, one after another; leave weights empty")
        return
    if {BUILTIN_CHAT, BUILTIN_PAIRS} & set(names) or any(n.endswith((".jsonl", ".parquet")) for n in names):
        raise ConfigError(f"data.dataset = {cfg.data.dataset!r}: chat data trains with training.objective = \"sft\" "
                          f"(pairs: \"dpo\"); pretraining reads .bin/.idx stores (tools/preprocess_data.py) or \"python_stdlib\"")
    w = cfg.data.weights
    if w and len(w) != len(names):
        raise ConfigError(f"data.weights = {w!r}: needs {len(names)} weights, one per data.dataset entry")
    if w and (not all(isinstance(x, (int, float)) and x >= 0 for x in w) or sum(w) <= 0):
        raise ConfigError(f"data.weights = {w!r}: must be non-negative numbers with a positive sum")
    for n in names:
        if n in BUILTIN:
            continue
        prefix = resolve(n, tok)
        if not store_mod.exists(prefix):
            raise ConfigError(f"data.dataset = {n!r}: no {prefix}.bin/.idx found; write one with "
                              f"tools/preprocess_data.py or use \"python_stdlib\"")
        try:
            s = store_mod.open_store(prefix)
            if s.vocab_size is not None and s.vocab_size != tok.vocab_size:
                raise ConfigError(f"data.dataset = {n!r}: written with a {s.vocab_size}-token tokenizer but "
                                  f"data.tokenizer = {cfg.data.tokenizer!r} has {tok.vocab_size}; use the tokenizer "
                                  f"it was made with")
            if s.vocab_size is None:  # a Megatron index does not say: every id must fit the tokenizer
                store_mod.check_token_ids(s.tokens, tok.vocab_size, prefix + ".bin")
        except StoreError as e:
            hint = (f"; use the tokenizer it was made with (data.tokenizer = {cfg.data.tokenizer!r} has "
                    f"{tok.vocab_size} tokens)" if "outside the vocabulary" in str(e) else "")
            raise ConfigError(f"data.dataset = {n!r}: {e}{hint}") from None
        if s.n_tokens < 2 * (cfg.data.seq_len + 1):
            raise ConfigError(f"data.dataset = {n!r}: only {s.n_tokens} tokens, too few for data.seq_len = {cfg.data.seq_len}")
