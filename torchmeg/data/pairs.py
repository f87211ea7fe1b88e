"""Preference pairs for DPO: records -> (chosen, rejected) token rows with their completion targets.

A record is read as TRL 1.16's DPOTrainer reads a preference example (JSON lines, or Parquet rows; or
the built-in `python_stdlib_pairs`): conversational, `{"prompt": [messages], "chosen": [messages],
"rejected": [messages]}` (`messages` also names the prompt; a side may be the answer's text), each side
the prompt plus it rendered with the chat template (torchmeg.data.chat, as transformers renders it);
standard, `{"prompt": "text", "chosen": "text", "rejected": "text"}`, the strings tokenized as the
tokenizer is configured with its end-of-sequence token ending each side, no template; without a
prompt, TRL's implicit prompt (the common start of chosen and rejected). A side's targets are its tokens
after the prompt (earlier assistant turns of a conversational prompt are context). One sample is one pair:
two rows of seq_len tokens, padded (no target) or truncated at the end (counted in the header).
Labels: token t+1 where it is a target, else IGNORE, as for sft.
"""
from __future__ import annotations

import hashlib
import os
import typing

import numpy as np
import torch

from torchmeg.data.chat import ChatDataError, check_turns, common_prefix_length, token_offsets
from torchmeg.data.chat_data import read_json_records, stdlib_conversations
from torchmeg.data.dataset import Shuffled
from torchmeg.data.sources import BUILTIN_PAIRS
from torchmeg.data.trl_records import encode_ended
from torchmeg.kernels.fused_ce import IGNORE


class Pair(typing.NamedTuple):
    """A preference record in TRL's terms: conversational (prompt, chosen, rejected: message lists) or
    standard (strings)."""
    prompt: list | str
    chosen: list | str
    rejected: list | str

    @property
    def conversational(self) -> bool:
        return isinstance(self.prompt, list)


def _messages_answer(value, key: str, where: str) -> list[dict]:
    """A conversational side: a message list, or (torchmeg's shorthand) the answer's text."""
    if isinstance(value, str):
        value = [{"role": "assistant", "content": value}]
    if not isinstance(value, list) or not value:
        raise ChatDataError(f"{where}: {key!r} must be a non-empty answer (a string, or a list of messages such as "
                            f"[{{'role': 'assistant', 'content': ...}}])")
    check_turns(value, where)
    if not any(m["content"].strip() for m in value):
        raise ChatDataError(f"{where}: {key!r} is empty (nothing to train on)")
    return value


def _extract_prompt(chosen, rejected):
    """TRL's `extract_prompt`: the longest common prefix of chosen and rejected (messages, or characters
    less a space before the split) is the prompt."""
    idx = 0
    for idx in range(min(len(chosen), len(rejected))):
        if chosen[idx] != rejected[idx]:
            if chosen[idx - 1] == " ":
                idx -= 1
            break
    return chosen[:idx], chosen[idx:], rejected[idx:]


def check_pair(record, where: str) -> Pair:
    """A record as TRL reads a preference example, or ChatDataError naming `where`: `prompt` a message
    list (conversational) or a string (standard); no `prompt`: TRL's implicit prompt, the common start of
    chosen and rejected; `messages` (torchmeg's name for a conversational prompt) as a message-list prompt.
    A conversational side may be given as the answer's text (one assistant message)."""
    if not isinstance(record, dict):
        raise ChatDataError(f"{where}: a pair is a JSON object with prompt (or messages), chosen, rejected")
    for key in ("chosen", "rejected"):
        if key not in record:
            raise ChatDataError(f"{where}: no {key!r} (a pair needs prompt or messages, chosen and rejected)")
    chosen, rejected = record["chosen"], record["rejected"]
    prompt = record.get("messages", record.get("prompt"))
    if prompt is None:  # TRL's implicit prompt
        if not (isinstance(chosen, type(rejected)) and isinstance(chosen, (str, list))):
            raise ChatDataError(f"{where}: without a prompt, chosen and rejected must both be conversations (message "
                                f"lists) or both strings (TRL's implicit prompt: their common start)")
        prompt, chosen, rejected = _extract_prompt(chosen, rejected)
    if isinstance(prompt, list):
        check_turns(prompt, where)
        return Pair(prompt, _messages_answer(chosen, "chosen", where), _messages_answer(rejected, "rejected", where))
    if not isinstance(prompt, str):
        raise ChatDataError(f"{where}: no prompt (a 'prompt' string or message list, or a 'messages' list)")
    for key, value in (("chosen", chosen), ("rejected", rejected)):
        if not isinstance(value, str) or not value.strip():
            raise ChatDataError(f"{where}: {key!r} must be a non-empty string beside a text prompt (TRL's standard "
                                f"format; a message-list prompt takes message answers)")
    return Pair(prompt, chosen, rejected)


def stdlib_pairs() -> list[dict]:
    """The built-in pairs: each question of python_stdlib_chat, its docstring answer chosen, and the
    same answer with its words in reverse order rejected — real words, a preference a small model can
    learn (fluent over scrambled) and that shows in the margin within tens of steps."""
    out = []
    for c in stdlib_conversations():
        q = next(m["content"] for m in c if m["role"] == "user")
        a = next(m["content"] for m in c if m["role"] == "assistant")
        words = a.split()
        if len(words) >= 4:
            out.append({"prompt": [{"role": "user", "content": q}], "chosen": [{"role": "assistant", "content": a}],
                        "rejected": [{"role": "assistant", "content": " ".join(reversed(words))}]})
    return out


def read_pairs(path: str):
    """Yield (where, record) of a pairs file (.jsonl or .parquet), or of the built-in set."""
    if path == BUILTIN_PAIRS:
        yield from ((f"{BUILTIN_PAIRS}[{i}]", r) for i, r in enumerate(stdlib_pairs()))
        return
    yield from read_json_records(path)


def encode_pair(template, tokenizer, pair: Pair) -> list[tuple[np.ndarray, np.ndarray]]:
    """[(ids, target mask) of chosen, of rejected], as TRL's DPOTrainer tokenizes a pair: prompt + side
    rendered with the chat template (conversational; ids as apply_chat_template gives them) or, standard,
    the strings with the tokenizer's end-of-sequence token added to each side unless it ends with it,
    tokenized as `tokenizer(text)`; the targets start where the prompt (with its generation prompt)
    and the sides' tokens part, the earlier of the two (TRL's `common_prefix_length`)."""
    if pair.conversational:
        if template is None:
            raise ChatDataError("a conversational pair needs a chat template: set data.chat_template (chatml, llama3, "
                                "a tokenizer folder or a .jinja file)")
        ids = lambda messages, gen=False: token_offsets(tokenizer, template.render(messages, gen))[0].tolist()  # noqa: E731
        prompt = ids(pair.prompt, True)
        sides = [ids(pair.prompt + pair.chosen), ids(pair.prompt + pair.rejected)]
    else:
        prompt = tokenizer.encode_with_specials(pair.prompt)
        sides = [encode_ended(tokenizer, pair.prompt, side) for side in (pair.chosen, pair.rejected)]
    cut = min(common_prefix_length(prompt, side) for side in sides)
    out = []
    for side in sides:
        mask = np.zeros(len(side), dtype=np.uint8)
        mask[cut:] = 1
        out.append((np.asarray(side, dtype=np.int64), mask))
    return out


class Pairs:
    """Every pair of the dataset list, tokenized: for pair k, rows 2k (chosen) and 2k + 1 (rejected)."""

    def __init__(self, paths: list[str], template, tokenizer):
        self.rows, self.sources = [], ", ".join(paths)
        for p in paths:
            if p != BUILTIN_PAIRS and not os.path.isfile(p):
                raise ChatDataError(f"{p}: no such pairs file (.jsonl or .parquet)")
            for where, record in read_pairs(p):
                pair = check_pair(record, where)
                try:
                    self.rows += encode_pair(template, tokenizer, pair)
                except ChatDataError as e:
                    raise ChatDataError(f"{where}: {e}") from None
                except Exception as e:  # the template raised or could not render the record
                    raise ChatDataError(f"{where}: the chat template cannot render it ({type(e).__name__}: {e})") from None
        if not self.rows:
            raise ChatDataError(f"{self.sources}: no pairs")
        h = hashlib.sha1()
        for ids, mask in self.rows:
            h.update(ids.astype(np.int64).tobytes())
            h.update(mask.tobytes())
        self.fingerprint = h.hexdigest()[:20]  # what the reference log-probs were computed for

    def __len__(self):
        return len(self.rows) // 2


class PairDataset(torch.utils.data.Dataset):
    """Global sample index -> (inputs [2, L], labels [2, L], pair number) of a shuffled pair; the
    last `val_fraction` of the pairs are the validation split. Batches: `collate` (rows interleaved)."""

    def __init__(self, pairs: Pairs, seq_len: int, seed: int, split: str, val_fraction: float, pad_id: int = 0):
        n = len(pairs)
        n_val = max(1, int(n * val_fraction)) if val_fraction > 0 else 0
        first, count = {"train": (0, n - n_val), "val": (n - n_val, n_val), "all": (0, n)}[split]
        if count <= 0:
            raise ChatDataError(f"{pairs.sources}: no {split} pairs ({n} in all, data.val_fraction = {val_fraction})")
        self.pairs, self.L, self.pad, self.first, self.n_unique = pairs, seq_len, pad_id, first, count
        self.truncated = sum(len(pairs.rows[r][0]) > seq_len for r in range(2 * first, 2 * (first + count)))
        self.src = Shuffled(range(count), seed * 1009 + 17, shuffle=split == "train")

    def __len__(self):  # endless epochs, as every loader here
        return 2 ** 62

    def _row(self, r: int) -> tuple[np.ndarray, np.ndarray]:
        ids, mask = self.pairs.rows[r]
        n = min(len(ids), self.L)
        inputs = np.full(self.L, self.pad, dtype=np.int64)
        labels = np.full(self.L, IGNORE, dtype=np.int64)
        inputs[:n] = ids[:n]
        labels[:n - 1] = np.where(mask[1:n] > 0, ids[1:n], IGNORE)
        return inputs, labels

    def sample_of_pair(self, k: int):
        """(inputs [2, L], labels [2, L]) of pair k (numbered over the whole file, either split)."""
        (ci, cl), (ri, rl) = self._row(2 * k), self._row(2 * k + 1)
        return torch.from_numpy(np.stack([ci, ri])), torch.from_numpy(np.stack([cl, rl]))

    def __getitem__(self, i: int):
        k = self.first + self.src.index(int(i))
        return (*self.sample_of_pair(k), k)

    def describe(self) -> str:
        return (f"{self.n_unique:,} pairs (chosen + rejected rows of {self.L}); {self.truncated} rows truncated "
                f"at seq_len")


def collate_pairs(samples):
    """[B] pairs -> inputs [2B, L], labels [2B, L] (rows chosen, rejected, chosen, ...), pair numbers [B]."""
    inputs = torch.cat([s[0] for s in samples])
    labels = torch.cat([s[1] for s in samples])
    return inputs, labels, torch.tensor([s[2] for s in samples], dtype=torch.int64)


PairDataset.collate = staticmethod(collate_pairs)
