"""TRL's SFT record formats beside `messages` (torchmeg.data.chat_data reads them all): the
conversational prompt-completion record (`prompt` and `completion` message lists: one conversation,
trained on the completion; encoded by chat.encode_conversation's `completion_from`), and the standard
records TRL's SFTTrainer reads without a chat template: prompt-completion strings (trained on the
completion) and language modeling `text` (every token), each ended by the tokenizer's end-of-sequence
token as TRL ends them. TRL 1.16's `SFTTrainer` on its defaults is the reference
(tests/test_chat_targets.py)."""
from __future__ import annotations

import functools
import json
import os
import typing

import numpy as np

from torchmeg.data.chat import ChatDataError, check_turns, common_prefix_length


def check_completion(prompt, completion, where: str) -> list[dict]:
    """TRL's conversational prompt-completion record as one conversation (check_turns), its completion
    holding something to train on; or ChatDataError naming `where` and what is wrong."""
    if not isinstance(completion, list) or not completion:
        raise ChatDataError(f"{where}: 'completion' must be a non-empty list of {{'role', 'content'}}")
    messages = check_turns(list(prompt) + list(completion), where)
    if not any(m["content"].strip() for m in completion):
        raise ChatDataError(f"{where}: the completion is empty (nothing to train on)")
    return messages


class TextRecord(typing.NamedTuple):
    """TRL's standard SFT record: prompt-completion strings (prompt the prompt, text the completion), or
    language modeling (prompt None, text the record's `text`)."""
    prompt: str | None
    text: str


def check_text(prompt, text, where: str) -> TextRecord:
    """A standard record's strings as a TextRecord, or ChatDataError naming `where` and what is wrong."""
    if not isinstance(text, str) or not text.strip() or (prompt is not None and not isinstance(prompt, str)):
        raise ChatDataError(f"{where}: {'the completion' if prompt is not None else 'text'} must be a non-empty string "
                            f"(nothing to train on)")
    return TextRecord(prompt, text)


def configured_eos(tokenizer) -> str | None:
    """The end-of-sequence token's text as transformers' tokenizer has it (`eos_token` of the
    tokenizer_config.json beside the tokenizer.json), or None (none configured; the byte tokenizer)."""
    path = getattr(tokenizer, "path", "")
    return _eos_of(os.path.join(os.path.dirname(path), "tokenizer_config.json")) if path else None


@functools.lru_cache(maxsize=8)
def _eos_of(config_path: str) -> str | None:
    """(read once per file: a data set asks for every record)"""
    if not os.path.isfile(config_path):
        return None
    with open(config_path) as fh:
        eos = json.load(fh).get("eos_token")
    return eos.get("content") if isinstance(eos, dict) else eos


def encode_ended(tokenizer, prompt: str, text: str) -> list[int]:
    """`tokenizer(prompt + text)` with the end-of-sequence token's text added to `text` unless it ends
    with it (TRL's `add_eos` for standard records); the byte tokenizer, which has no such text, gets its
    end-of-document id appended instead."""
    eos = configured_eos(tokenizer)
    if eos is None:
        return tokenizer.encode_with_specials(prompt + text) + [tokenizer.eos_id]
    return tokenizer.encode_with_specials(prompt + (text if text.endswith(eos) else text + eos))


def encode_text(tokenizer, record: TextRecord, train_on_prompt: bool = False) -> tuple[np.ndarray, np.ndarray]:
    """(ids, target mask) of a TRL standard record as TRL's SFTTrainer builds it: the end-of-sequence
    token's text added to the completion (or text) unless it ends with it, the whole tokenized as the
    tokenizer is configured (`tokenizer(text)`: a BOS where its post-processor adds one); targets every
    token of a `text` record, or those after the tokenized prompt's common prefix with the whole (or
    every one with `train_on_prompt`). The byte tokenizer has no end-of-sequence text: its
    end-of-document id is appended instead."""
    ids = encode_ended(tokenizer, record.prompt or "", record.text)
    start = 0
    if record.prompt is not None and not train_on_prompt:
        prompt = tokenizer.encode_with_specials(record.prompt)
        start = common_prefix_length(prompt, ids)
    mask = np.zeros(len(ids), dtype=np.uint8)
    mask[start:] = 1
    return np.asarray(ids, dtype=np.int64), mask
