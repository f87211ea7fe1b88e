"""The tokenizer and generation settings beside an exported model, so the folder stands alone: what
`AutoTokenizer.from_pretrained`, `generate`, lm-eval's `hf` backend, vLLM and the Hub read.

- `data.tokenizer` a tokenizer.json: the file, and what its folder holds beside it (tokenizer_config.json,
  special_tokens_map.json, chat_template.jinja, generation_config.json: a converted release's own);
  without a tokenizer_config.json, one is written naming the end-of-text token. An end of text the
  vocabulary lacks (torchmeg reserves the id past it) is added to the exported vocabulary as
  `<|endoftext|>` at that id.
- `data.tokenizer = "byte"`: a byte-level tokenizer.json transformers loads with the same ids (byte b
  is id b through GPT-2's byte-to-symbol table, no merges; id 256 is `<|endoftext|>`).
- The recipe's chat template (`data.chat_template`, when set) as chat_template.jinja; a built-in one's
  special variables a tokenizer does not define (llama3's bos_token) are set inside it, so transformers
  renders what torchmeg trained on.
- config.json gets `eos_token_id` / `bos_token_id` / `pad_token_id` as torchmeg used them, and
  generation_config.json (unless the release brought one): the end of text, and for a chat-trained
  run (sft, dpo, grpo) also the template's one-token end of turn, as instruct releases list both.
"""
from __future__ import annotations

import json
import os
import shutil

from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

from torchmeg.config.errors import ConfigError
from torchmeg.data.chat import chat_template
from torchmeg.data.tokenizer import byte_symbol_table

BESIDE = ("tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja", "generation_config.json")
EOT_TEXT = "<|endoftext|>"


def byte_level_tokenizer():
    """The byte tokenizer (ids 0-255 = UTF-8 bytes, 256 = end of text) as a `tokenizers` Tokenizer:
    GPT-2's byte symbols as a BPE vocabulary without merges, so every byte stays its own token."""
    tok = Tokenizer(models.BPE(vocab={ch: b for b, ch in byte_symbol_table().items()}, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken(EOT_TEXT, special=True, normalized=False)])
    return tok


def copy_files(source: str, folder: str, names) -> None:
    """Each of `names` that `source` holds, copied into `folder`."""
    for name in names:
        if os.path.isfile(os.path.join(source, name)):
            shutil.copy(os.path.join(source, name), os.path.join(folder, name))


def _token(tok, i: int | None) -> str | None:
    return tok.id_to_token(i) if i is not None and i >= 0 else None


def write_tokenizer(cfg, tokenizer, folder: str) -> dict:
    """The run's tokenizer (and chat template) into `folder`; -> the special ids for config.json."""
    spec = cfg.data.tokenizer
    config: dict = {}
    if spec == "byte":
        tok = byte_level_tokenizer()
        tok.save(os.path.join(folder, "tokenizer.json"))
    else:
        copy_files(os.path.dirname(os.path.abspath(spec)), folder, BESIDE)
        tok = Tokenizer.from_file(spec)
        if tokenizer.eos_id >= tok.get_vocab_size(with_added_tokens=True):  # the reserved id past the vocab
            tok.add_special_tokens([AddedToken(EOT_TEXT, special=True, normalized=False)])
            if tok.token_to_id(EOT_TEXT) != tokenizer.eos_id:
                raise ConfigError(f"data.tokenizer = {spec!r}: {EOT_TEXT} is in the vocabulary but is not the end of "
                                  f"text torchmeg used (id {tokenizer.eos_id}); the export cannot name it")
            tok.save(os.path.join(folder, "tokenizer.json"))
        else:
            shutil.copy(spec, os.path.join(folder, "tokenizer.json"))
        path = os.path.join(folder, "tokenizer_config.json")
        if os.path.isfile(path):
            with open(path) as fh:
                config = json.load(fh)
    config.setdefault("tokenizer_class", "PreTrainedTokenizerFast")
    config.setdefault("eos_token", _token(tok, tokenizer.eos_id))
    config.setdefault("model_max_length", cfg.data.seq_len)
    if cfg.data.chat_template:
        _write_template(cfg, config, folder)
    with open(os.path.join(folder, "tokenizer_config.json"), "w") as fh:
        json.dump(config, fh, indent=1)
    ids = {"eos_token_id": tokenizer.eos_id}
    for key in ("bos_token", "pad_token"):
        text = config.get(key)
        text = text.get("content") if isinstance(text, dict) else text
        if isinstance(text, str) and tok.token_to_id(text) is not None:
            ids[key + "_id"] = tok.token_to_id(text)
    return ids


def _write_template(cfg, config: dict, folder: str) -> None:
    """data.chat_template as chat_template.jinja (it replaces one the tokenizer folder brought)."""
    template = chat_template(cfg)
    lead = "".join("{%- set " + k + " = " + json.dumps(v) + " %}\n" for k, v in sorted(template.special.items())
                   if k not in config)
    config.pop("chat_template", None)
    with open(os.path.join(folder, "chat_template.jinja"), "w") as fh:
        fh.write(lead + template.source)


def write_generation_files(cfg, tokenizer, folder: str) -> None:
    """The folder's tokenizer files, the special ids in config.json, and generation_config.json.
    A release's own generation_config.json (copied from beside the tokenizer) is kept, and its ids are
    the ones config.json gets (an instruct release's end-of-turn list included). Run after the weights
    and config.json are written."""
    ids = write_tokenizer(cfg, tokenizer, folder)
    generation_path = os.path.join(folder, "generation_config.json")
    if os.path.isfile(generation_path):
        with open(generation_path) as fh:
            release = json.load(fh)
        ids.update({k: release[k] for k in ("bos_token_id", "eos_token_id", "pad_token_id") if release.get(k) is not None})
    else:
        _write_generation_config(cfg, tokenizer, ids, generation_path)
    path = os.path.join(folder, "config.json")
    with open(path) as fh:
        config = json.load(fh)
    config.update(ids)
    with open(path, "w") as fh:
        json.dump(config, fh, indent=1)


def _write_generation_config(cfg, tokenizer, ids: dict, path: str) -> None:
    """The end of text; for a chat-trained run (sft, dpo, grpo) also the template's one-token end of
    turn, as instruct releases list both (greedy: transformers' default, torchmeg.generate's too)."""
    eos = [ids["eos_token_id"]]
    if cfg.training.objective != "pretrain" and (cfg.data.chat_template or cfg.data.tokenizer != "byte"):
        try:
            end_id = chat_template(cfg).end_of_turn(tokenizer)[1]
        except ConfigError:  # a tokenizer folder without a template: the end of text alone
            end_id = None
        if end_id is not None and end_id not in eos:
            eos.append(end_id)
    generation = {k: v for k, v in ids.items() if k != "eos_token_id"}
    generation["eos_token_id"] = eos[0] if len(eos) == 1 else eos
    with open(path, "w") as fh:
        json.dump(generation, fh, indent=1)
