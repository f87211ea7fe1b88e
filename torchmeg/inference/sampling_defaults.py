"""A model's sampling defaults, as vLLM takes them: with `--generation-config auto` (vLLM's default,
for its server and its offline `LLM.generate`) the generation_config.json shipped with the model sets
the defaults of the fields a request (torchmeg.serve) or the command line (torchmeg.generate) leaves
out (vLLM's `get_diff_sampling_param`: temperature, top_p, top_k, min_p, repetition_penalty, and
max_new_tokens: the chat default's cap when serving, the number of new tokens when generating).
`--generation-config vllm`: the API's own defaults (temperature 1, top_p 1, no top-k, min-p or
repetition penalty; greedy for torchmeg.generate). The file is the one beside the tokenizer.json
(`torchmeg.convert from-hf` copies a release's there); the byte tokenizer has none.
"""
from __future__ import annotations

import json
import os

from torchmeg.config.errors import ConfigError
from torchmeg.data.tokenizer import generation_config

APPLIED = {"temperature": "temperature", "top_p": "top_p", "top_k": "top_k", "min_p": "min_p",
           "repetition_penalty": "repetition_penalty", "max_new_tokens": "max_tokens"}
RANGES = {"top_p": (0.0, 1.0, False), "min_p": (0.0, 1.0, True), "repetition_penalty": (0.0, 2.0, False)}  # lo, hi, lo in


def sampling_defaults(tokenizer, mode: str = "auto") -> tuple[dict, str]:
    """-> ({request field: default} from the model's generation_config.json, a note for the header
    line ('' when there is nothing to say)."""
    path = generation_config(tokenizer.path) if getattr(tokenizer, "path", "") else ""
    if mode == "vllm" or not path or not os.path.isfile(path):
        return {}, ""
    try:
        with open(path) as fh:
            config = json.load(fh)
        if not isinstance(config, dict):
            raise ValueError("not a JSON object")
    except (OSError, ValueError) as e:
        raise ConfigError(f"{path}: not a JSON object ({str(e).splitlines()[0]}); fix or remove it, or run with "
                          f"--generation-config vllm") from None
    out = {ours: config[key] for key, ours in APPLIED.items() if config.get(key) is not None}
    for key, value in out.items():
        if isinstance(value, bool) or not isinstance(value, (int, float)) or value < 0 or \
                (key in ("max_tokens", "top_k") and not isinstance(value, int)):
            raise ConfigError(f"{path}: {key} = {value!r} is not a valid default; fix it, or run with "
                              f"--generation-config vllm")
    for key, (lo, hi, lo_in) in RANGES.items():
        v = out.get(key)
        if v is not None and not ((lo <= v if lo_in else lo < v) and v <= hi):
            raise ConfigError(f"{path}: {key} = {out[key]!r} must be in {'[' if lo_in else '('}{lo:g}, {hi:g}]; fix "
                              f"it, or run with --generation-config vllm")
    note = f"sampling defaults from {path}: " + ", ".join(f"{k} {v}" for k, v in out.items()) if out else ""
    return out, note
