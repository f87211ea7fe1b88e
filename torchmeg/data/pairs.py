"""Preference pairs for DPO: records -> (chosen, rejected) token rows with their completion targets.

A record is `{"prompt": "text" | "messages": [...], "chosen": ..., "rejected": ...}` (JSON lines, or
Parquet rows; or the built-in `python_stdlib_pairs`), where chosen / rejected are the answer's text or a list holding one assistant message
(TRL's conversational format). Each side is the prompt's conversation plus that answer, rendered with
the chat template (torchmeg.data.chat, as transformers renders it); its targets are the answer's tokens
and the end of turn only (earlier assistant turns of the prompt are context). One sample is one pair:
two rows of seq_len tokens, padded (no target) or truncated at the end (counted in the header).
Labels: token t+1 where it is a target, else IGNORE, as for sft.
"""
from __future__ import annotations

import hashlib
import os

import numpy as np
import torch

from torchmeg.data.chat import ChatDataError, check_messages, encode_conversation
from torchmeg.data.chat_data import read_json_records, stdlib_conversations
from torchmeg.data.dataset import Shuffled
from torchmeg.data.sources import BUILTIN_PAIRS
from torchmeg.kernels.fused_ce import IGNORE


def _answer(value, key: str, where: str) -> str:
    if isinstance(value, list) and len(value) == 1 and isinstance(value[0], dict):
        value = value[0].get("content")
    if not isinstance(value, str) or not value.strip():
        raise ChatDataError(f"{where}: {key!r} must be a non-empty answer (a string, or [{{'role': 'assistant', "
                            f"'content': ...}}])")
    return value


def check_pair(record, where: str) -> tuple[list[dict], str, str]:
    """(prompt messages, chosen, rejected) of a record, or ChatDataError naming `where`."""
    if not isinstance(record, dict):
        raise ChatDataError(f"{where}: a pair is a JSON object with prompt (or messages), chosen, rejected")
    for key in ("chosen", "rejected"):
        if key not in record:
            raise ChatDataError(f"{where}: no {key!r} (a pair needs prompt or messages, chosen and rejected)")
    if "messages" in record:
        prompt = record["messages"]
        if not isinstance(prompt, list) or not prompt:
            raise ChatDataError(f"{where}: 'messages' must be a non-empty list of {{'role', 'content'}}")
        check_messages(prompt + [{"role": "assistant", "content": "x"}], where)
    elif isinstance(record.get("prompt"), str) and record["prompt"].strip():
        prompt = [{"role": "user", "content": record["prompt"]}]
    else:
        raise ChatDataError(f"{where}: no prompt (a non-empty 'prompt' string or a 'messages' list)")
    return prompt, _answer(record["chosen"], "chosen", where), _answer(record["rejected"], "rejected", where)


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
            out.append({"prompt": q, "chosen": a, "rejected": " ".join(reversed(words))})
    return out


def read_pairs(path: str):
    """Yield (where, record) of a pairs file (.jsonl or .parquet), or of the built-in set."""
    if path == BUILTIN_PAIRS:
        yield from ((f"{BUILTIN_PAIRS}[{i}]", r) for i, r in enumerate(stdlib_pairs()))
        return
    yield from read_json_records(path)


def encode_side(template, tokenizer, prompt: list[dict], answer: str) -> tuple[np.ndarray, np.ndarray]:
    """(ids, target mask) of prompt + answer: only the answer (and its end of turn) are targets."""
    return encode_conversation(template, tokenizer, prompt + [{"role": "assistant", "content": answer}],
                               last_only=True)


class Pairs:
    """Every pair of the dataset list, tokenized: for pair k, rows 2k (chosen) and 2k + 1 (rejected)."""

    def __init__(self, paths: list[str], template, tokenizer):
        self.rows, self.sources = [], ", ".join(paths)
        for p in paths:
            if p != BUILTIN_PAIRS and not os.path.isfile(p):
                raise ChatDataError(f"{p}: no such pairs file (.jsonl or .parquet)")
            for where, record in read_pairs(p):
                prompt, chosen, rejected = check_pair(record, where)
                try:
                    self.rows += [encode_side(template, tokenizer, prompt, chosen),
                                  encode_side(template, tokenizer, prompt, rejected)]
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
