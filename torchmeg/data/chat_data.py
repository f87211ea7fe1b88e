"""Supervised fine-tuning data: chat files -> tokenized conversations -> packed windows.

Records are `{"messages": [{"role", "content"}, ...]}` or TRL's other formats: prompt-completion
`{"prompt": [...], "completion": [...]}` (message lists, or strings: trained on the completion) and
language modeling `{"text": "..."}` (every token), one per line of a `.jsonl` file or one per row of a
`.parquet` file (pyarrow), or the built-in `python_stdlib_chat` (question-and-answer
conversations about the standard library, built from its own docstrings: real text, no download).
Each conversation is rendered with the chat template and tokenized once (torchmeg.data.chat), and
kept in the data cache keyed by the file's contents, the template, the tokenizer and the options.

Windows: conversations are packed whole, in file order, into windows of seq_len tokens (a new
window starts when the next one does not fit; the rest of a window is padding that is no target).
Every window carries the conversation number of each token, so attention stays inside a
conversation and positions restart at each (document masking). A conversation longer than seq_len
is truncated to its first seq_len tokens or dropped (data.long_conversations), counted in the log.
Labels: token t+1 where it is a target of the same conversation, else IGNORE.
"""
from __future__ import annotations

import hashlib
import importlib
import inspect
import json
import os
import sys
import textwrap
from dataclasses import dataclass

import numpy as np
import torch

from torchmeg.data.chat import ChatDataError, ChatTemplate, check_messages, encode_conversation
from torchmeg.data.trl_records import TextRecord, check_completion, check_text, encode_text
from torchmeg.data.dataset import Shuffled
from torchmeg.data.sources import BUILTIN_CHAT
from torchmeg.kernels.fused_ce import IGNORE

_FORMAT = "chat-v2"  # bump when the cached arrays' meaning changes (v2: targets from the structure)


@dataclass(frozen=True)
class Targets:
    """Which tokens of an SFT record are targets: TRL's SFTConfig flags, on TRL's defaults.
    `assistant_only` (TRL's assistant_only_loss, default False): a conversation's assistant turns only,
    else every token; `completion_only` (TRL's completion_only_loss, whose default None is True for
    prompt-completion records): a prompt-completion record's completion only. Both apply to a
    conversational prompt-completion record (TRL masks with both). `data.train_on_prompt`: every token."""
    assistant_only: bool = False
    completion_only: bool = True

    @classmethod
    def of(cls, data) -> "Targets":
        return cls(False, False) if data.train_on_prompt else cls(data.assistant_only_loss, data.completion_only_loss)


def encode_record(template: ChatTemplate, tokenizer, record, completion_from: int | None,
                  targets: Targets) -> tuple[np.ndarray, np.ndarray]:
    """(ids, target mask) of one record of any format (read_records), its targets as TRL's SFTTrainer
    picks them under the same flags."""
    if isinstance(record, TextRecord):
        return encode_text(tokenizer, record, train_on_prompt=not targets.completion_only)
    if completion_from is None or not targets.completion_only:
        return encode_conversation(template, tokenizer, record, train_on_prompt=not targets.assistant_only)
    ids, mask = encode_conversation(template, tokenizer, record, completion_from=completion_from)
    if targets.assistant_only:  # and the assistant turns within the completion
        same, assistant = encode_conversation(template, tokenizer, record)
        if not np.array_equal(same, ids):
            raise ChatDataError("the template renders the record two ways; it cannot take assistant_only_loss")
        mask &= assistant
    return ids, mask


# ---- records ------------------------------------------------------------------------------------

def read_json_records(path: str):
    """Yield (where, record) of a .jsonl file (a JSON value per non-blank line; where = 'file:line') or
    a .parquet file (each row as a dict; where = 'file:row N'). Anything unreadable: ChatDataError
    naming the file (and the line)."""
    if path.endswith(".parquet"):
        try:
            import pyarrow.parquet as pq  # lazy: an optional extra (data), for Parquet input only
            rows = pq.read_table(path).to_pylist()
        except ImportError:
            raise ChatDataError(f"{path}: reading Parquet needs pyarrow, which is not installed: pip install "
                                f"'torchmeg[data]' (from a checkout: pip install -e '.[data]')") from None
        except Exception as e:  # pyarrow raises several types for damaged files
            raise ChatDataError(f"{path}: not a readable Parquet file ({e})") from None
        for row, record in enumerate(rows):
            yield f"{path}:row {row}", record
        return
    try:
        fh = open(path, encoding="utf-8")
    except OSError as e:
        raise ChatDataError(f"{path}: cannot be read ({e.strerror})") from None
    with fh:
        for n, line in enumerate(fh, 1):
            if line.strip():
                try:
                    record = json.loads(line)
                except json.JSONDecodeError as e:
                    raise ChatDataError(f"{path}:{n}: not JSON ({e.msg} at column {e.colno})") from None
                yield f"{path}:{n}", record


def read_records(path: str):
    """Yield (where, messages, completion_from) for each record of a chat file, checked
    (torchmeg.data.chat.check_messages). A `messages` record: completion_from None. TRL's
    conversational prompt-completion record (`prompt` and `completion`, each a list of messages): the
    conversation prompt + completion, completion_from = len(prompt) (trained on the completion, as
    TRL's default `completion_only_loss` for such records). TRL's standard records (`prompt` and
    `completion` strings; `text`, language modeling): a chat.TextRecord in place of the messages."""
    for where, record in read_json_records(path):
        if isinstance(record, dict) and "messages" not in record and "prompt" in record and "completion" in record:
            prompt, completion = record["prompt"], record["completion"]
            if isinstance(prompt, str) and isinstance(completion, str):  # TRL's standard prompt-completion
                yield where, check_text(prompt, completion, where), None
            elif isinstance(prompt, list) and isinstance(completion, list):
                yield where, check_completion(prompt, completion, where), len(prompt)
            else:
                raise ChatDataError(f"{where}: 'prompt' and 'completion' must both be strings or both lists of "
                                    f"{{'role', 'content'}} (TRL's standard and conversational formats)")
            continue
        if isinstance(record, dict) and "messages" not in record and "text" in record:  # TRL's language modeling
            yield where, check_text(None, record["text"], where), None
            continue
        if not isinstance(record, dict) or not isinstance(record.get("messages"), list):
            raise ChatDataError(f"{where}: a record needs a 'messages' list (or TRL's 'prompt' and 'completion', "
                                f"or 'text')")
        yield where, check_messages(record["messages"], where), None


def stdlib_conversations() -> list[list[dict]]:
    """The built-in chat set: for public functions and classes of some standard modules with a
    docstring, 'what does X do' answered by its docstring's first paragraph, and for about a third a
    second turn asking how to call it, answered by its signature. Deterministic for a Python version."""
    modules = ["json", "os.path", "shutil", "textwrap", "string", "re", "functools", "itertools", "collections",
               "heapq", "bisect", "statistics", "math", "random", "datetime", "pathlib", "difflib", "fnmatch",
               "glob", "html", "base64", "csv", "urllib.parse", "copy", "pprint", "calendar", "fractions",
               "decimal", "operator", "inspect", "zipfile", "tarfile", "gzip", "hashlib", "secrets", "uuid",
               "ipaddress", "argparse", "logging", "typing", "shlex", "struct", "tempfile", "time", "unicodedata",
               "colorsys", "keyword", "linecache", "tokenize", "ast", "dis", "enum", "dataclasses", "contextlib"]
    system = "You are a concise assistant who explains Python's standard library."
    out = []
    for mod_name in modules:
        try:
            mod = importlib.import_module(mod_name)
        except ImportError:
            continue
        for name in sorted(vars(mod)):
            obj = getattr(mod, name)
            if name.startswith("_") or not (inspect.isfunction(obj) or inspect.isbuiltin(obj) or inspect.isclass(obj)):
                continue
            if getattr(obj, "__module__", None) not in (mod_name, mod.__name__, "_" + mod.__name__):
                continue  # defined here (or in its C accelerator), not imported from elsewhere
            doc = inspect.getdoc(obj)
            if not doc:
                continue
            answer = textwrap.shorten(" ".join(doc.split("\n\n")[0].split()), 700, placeholder=" ...")
            if len(answer) < 20:
                continue
            full = f"{mod_name}.{name}"
            k = len(out)
            messages = ([{"role": "system", "content": system}] if k % 4 == 0 else []) + [
                {"role": "user", "content": f"What does `{full}` do?"},
                {"role": "assistant", "content": answer}]
            try:
                sig = str(inspect.signature(obj))
            except (TypeError, ValueError):
                sig = None
            if sig is not None and k % 3 == 0:
                messages += [{"role": "user", "content": "How do I call it?"},
                             {"role": "assistant", "content": f"`{full}{sig}`"}]
            out.append(messages)
    return out


# ---- tokenized conversations, cached ------------------------------------------------------------

class Conversations:
    """All conversations of the dataset list, tokenized: ids and target mask concatenated, and each
    conversation's start (starts[-1] = total tokens)."""

    def __init__(self, ids: np.ndarray, mask: np.ndarray, starts: np.ndarray, sources: str, template: str = ""):
        self.ids, self.mask, self.starts, self.sources, self.template = ids, mask, starts, sources, template

    def __len__(self):
        return len(self.starts) - 1

    def get(self, k: int) -> tuple[np.ndarray, np.ndarray]:
        a, b = self.starts[k], self.starts[k + 1]
        return self.ids[a:b], self.mask[a:b]


def _fingerprint(paths: list[str], template: ChatTemplate, tokenizer, targets: Targets) -> str:
    h = hashlib.sha1(f"{_FORMAT}|{template.source}|{sorted(template.special.items())}|{tokenizer.fingerprint()}|"
                     f"{targets.assistant_only}|{targets.completion_only}".encode())
    for p in paths:
        if p == BUILTIN_CHAT:
            h.update(f"builtin|py{sys.version_info.major}.{sys.version_info.minor}".encode())
            continue
        with open(p, "rb") as fh:
            for chunk in iter(lambda: fh.read(1 << 20), b""):
                h.update(chunk)
    return h.hexdigest()[:20]


def tokenize_conversations(paths: list[str], template: ChatTemplate, tokenizer, targets: Targets,
                           cache: str | None) -> Conversations:
    """Every record of `paths`, rendered and tokenized (from the cache when it was done before)."""
    for p in paths:
        if p != BUILTIN_CHAT and not os.path.isfile(p):
            raise ChatDataError(f"{p}: no such chat file (data.dataset lists .jsonl / .parquet files or {BUILTIN_CHAT})")
    key = _fingerprint(paths, template, tokenizer, targets)
    cached = os.path.join(cache, f"chat-{key}.npz") if cache else None
    if cached and os.path.isfile(cached):
        with np.load(cached) as z:
            return Conversations(z["ids"], z["mask"], z["starts"], ", ".join(paths), template.name)
    ids, mask, starts = [], [], [0]
    for p in paths:
        records = (((f"{BUILTIN_CHAT}[{i}]", m, None) for i, m in enumerate(stdlib_conversations()))
                   if p == BUILTIN_CHAT else read_records(p))
        for where, messages, completion_from in records:
            try:
                a, m = encode_record(template, tokenizer, messages, completion_from, targets)
            except ChatDataError as e:
                raise ChatDataError(f"{where}: {e}") from None
            except Exception as e:  # the template raised (raise_exception) or could not render the record
                raise ChatDataError(f"{where}: the chat template cannot render it ({type(e).__name__}: {e})") from None
            ids.append(a.astype(np.int32))
            mask.append(m)
            starts.append(starts[-1] + len(a))
    if len(starts) == 1:
        raise ChatDataError(f"{', '.join(paths)}: no conversations")
    conv = Conversations(np.concatenate(ids), np.concatenate(mask), np.asarray(starts, dtype=np.int64), ", ".join(paths),
                         template.name)
    if cached:
        tmp = f"{cached}.{os.getpid()}.npz"
        np.savez(tmp, ids=conv.ids, mask=conv.mask, starts=conv.starts)
        os.replace(tmp, cached)  # atomic: concurrent builders write the same bytes
    return conv


# ---- packed windows ------------------------------------------------------------------------------

class ChatWindows:
    """Conversations packed whole into windows of `seq_len` positions (see the module docstring).
    Split: the last `val_fraction` of the windows are held out ("val"), the rest "train"."""

    def __init__(self, conv: Conversations, seq_len: int, split: str, val_fraction: float, long: str,
                 pad_id: int):
        self.conv, self.L, self.pad = conv, seq_len, pad_id
        windows, current, used = [], [], 0
        self.truncated = self.dropped = 0
        for k in range(len(conv)):
            n = int(conv.starts[k + 1] - conv.starts[k])
            if n > seq_len:
                if long == "drop":
                    self.dropped += 1
                    continue
                self.truncated += 1
                n = seq_len
            if used + n > seq_len:
                windows.append(current)
                current, used = [], 0
            current.append((k, n))
            used += n
        if current:
            windows.append(current)
        n_all = len(windows)
        n_val = max(1, int(n_all * val_fraction)) if val_fraction > 0 else 0
        first, count = {"train": (0, n_all - n_val), "val": (n_all - n_val, n_val), "all": (0, n_all)}[split]
        self.windows = windows[first:first + count]
        if not self.windows:
            raise ChatDataError(f"{conv.sources}: no {split} windows ({n_all} windows of {seq_len} tokens in all)")
        self.filled = sum(n for w in self.windows for _, n in w)
        self.targets = sum(int(conv.get(k)[1][1:n].sum()) for w in self.windows for k, n in w)

    def __len__(self):
        return len(self.windows)

    def sample(self, j: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(inputs [L], labels [L], documents [L]) of window j."""
        inputs = np.full(self.L, self.pad, dtype=np.int64)
        labels = np.full(self.L, IGNORE, dtype=np.int64)
        docs = np.empty(self.L, dtype=np.int64)
        at = 0
        for d, (k, n) in enumerate(self.windows[j]):
            ids, mask = self.conv.get(k)
            ids, mask = ids[:n], mask[:n]
            inputs[at:at + n] = ids
            # position i predicts token i+1 of the same conversation, when that token is a target
            labels[at:at + n - 1] = np.where(mask[1:] > 0, ids[1:], IGNORE)
            docs[at:at + n] = d
            at += n
        docs[at:] = len(self.windows[j])  # the padding: a document of its own
        return torch.from_numpy(inputs), torch.from_numpy(labels), torch.from_numpy(docs)

    def describe(self) -> str:
        n_conv = sum(len(w) for w in self.windows)
        return (f"{n_conv:,} conversations in {len(self):,} windows of {self.L} ({self.filled / (len(self) * self.L):.0%} "
                f"filled, {self.targets / max(1, self.filled):.0%} of tokens are targets); "
                f"{self.truncated} truncated, {self.dropped} dropped over seq_len")


class ChatDataset(torch.utils.data.Dataset):
    """Global sample index -> (inputs, labels, documents) of a shuffled window (endless epochs)."""

    def __init__(self, windows: ChatWindows, seed: int, split: str, documents: bool = True):
        self.windows, self.documents = windows, documents
        self.template_name = windows.conv.template
        self.src = Shuffled(windows, seed * 1009, shuffle=split == "train")
        self.n_unique = len(windows)

    def __getitem__(self, i: int):
        inputs, labels, docs = self.windows.sample(self.src.index(int(i)))
        return (inputs, labels, docs) if self.documents else (inputs, labels)

    def __len__(self):
        return 2 ** 62
