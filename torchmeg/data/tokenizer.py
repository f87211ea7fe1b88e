"""Tokenizers: a built-in byte-level one, and any HuggingFace `tokenizer.json` via `tokenizers`."""
from __future__ import annotations

import functools
import hashlib
import json
import os

import numpy as np
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from torchmeg.config.errors import ConfigError


class ByteTokenizer:
    """UTF-8 bytes are ids 0..255; 256 is end-of-document. Needs no file and no download."""

    name = "byte"
    eos_id = 256
    vocab_size = 257
    end_ids = frozenset({256})

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def encode_with_specials(self, text: str) -> list[int]:
        return self.encode(text)  # (no special token is added to a text)

    def encode_np(self, text: str) -> np.ndarray:
        return np.frombuffer(text.encode("utf-8"), dtype=np.uint8).astype(np.int64)

    def decode(self, ids) -> str:
        return bytes(int(i) for i in ids if int(i) < 256).decode("utf-8", errors="replace")

    def fingerprint(self) -> str:
        return "byte-v1"

    def token_bytes(self) -> list[int]:
        """UTF-8 bytes each id stands for (bits per byte); end-of-document: none."""
        return [1] * 256 + [0]


class HFTokenizer:
    """A `tokenizer.json` (BPE, WordPiece, ...) loaded with the `tokenizers` library."""

    def __init__(self, path: str):
        self.path = path
        self.tok = Tokenizer.from_file(path)
        self.name = os.path.basename(path)
        self.vocab_size = self.tok.get_vocab_size(with_added_tokens=True)
        eos = None
        for cand in ("<|end_of_text|>", "<|endoftext|>", "</s>", "<eos>", "[SEP]"):
            eos = self.tok.token_to_id(cand)
            if eos is not None:
                break
        # No end-of-document token in the vocab: reserve one id past it.
        if eos is None:
            eos = self.vocab_size
            self.vocab_size += 1
        self.eos_id = eos
        self.end_ids = frozenset({eos} | generation_ends(generation_config(path), self.vocab_size))

    def encode(self, text: str) -> list[int]:
        return self.tok.encode(text, add_special_tokens=False).ids

    def encode_with_specials(self, text: str) -> list[int]:
        """As the tokenizer is configured: its post-processor's special tokens added (a Llama-3 style
        tokenizer.json's BOS), what `tokenizer(text)` gives in transformers. Documents are encoded
        without them (`encode`); a prompt a user writes is encoded with them (GRPO's, as TRL does)."""
        return self.tok.encode(text, add_special_tokens=True).ids

    def encode_np(self, text: str) -> np.ndarray:
        return np.asarray(self.encode(text), dtype=np.int64)

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        return [e.ids for e in self.tok.encode_batch(texts, add_special_tokens=False)]

    def decode(self, ids) -> str:
        return self.tok.decode([int(i) for i in ids if int(i) < self.tok.get_vocab_size()])

    def fingerprint(self) -> str:
        with open(self.path, "rb") as fh:
            return "hf-" + hashlib.sha1(fh.read()).hexdigest()[:16]

    def token_bytes(self) -> list[int] | None:
        """UTF-8 bytes each id stands for (bits per byte): exact for byte-level BPE (GPT-2 style,
        every token a string of byte symbols), None for other tokenizers; special tokens: none."""
        if type(self.tok.decoder).__name__ != "ByteLevel":
            return None
        symbol = {ch: 1 for ch in byte_symbols()}
        special = {i for i, t in self.tok.get_added_tokens_decoder().items() if t.special}
        out = [0] * self.vocab_size
        for i in range(self.tok.get_vocab_size()):
            t = self.tok.id_to_token(i)
            if t is not None and i not in special:
                out[i] = sum(symbol.get(ch, len(ch.encode())) for ch in t)
        return out


def generation_config(tokenizer_path: str) -> str:
    """The generation_config.json beside a tokenizer.json (from-hf copies a release's there)."""
    return os.path.join(os.path.dirname(tokenizer_path), "generation_config.json")


def generation_ends(path: str, vocab_size: int) -> set[int]:
    """The ids a release says end a generation: `eos_token_id` (an id or a list) of its
    generation_config.json at `path`, as transformers' `generate` and vLLM stop at them (an instruct
    release lists its end of turn beside its end of text). No such file: none. A malformed one, or ids
    outside the vocabulary: one line naming the file."""
    if not os.path.isfile(path):
        return set()
    try:
        with open(path) as fh:
            ends = json.load(fh).get("eos_token_id")
    except (OSError, ValueError, AttributeError) as e:
        raise ConfigError(f"{path}: not a JSON object ({str(e).splitlines()[0]}); fix or remove it") from None
    ends = [] if ends is None else ends if isinstance(ends, list) else [ends]
    if not all(isinstance(i, int) and 0 <= i < vocab_size for i in ends):
        raise ConfigError(f"{path}: eos_token_id {ends} must be token ids in [0, {vocab_size}) of the "
                          f"tokenizer.json beside it; fix the file or remove it")
    return set(ends)


def byte_symbol_table() -> dict[int, str]:
    """{byte: the printable character byte-level BPE writes it as} (GPT-2's bytes_to_unicode): printable
    bytes as themselves, the others as chr(256 + i) in byte order."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + \
        list(range(ord("®"), ord("ÿ") + 1))
    extra = [b for b in range(256) if b not in printable]
    return {**{b: chr(b) for b in printable}, **{b: chr(256 + i) for i, b in enumerate(extra)}}


def byte_symbols() -> list[str]:
    """The 256 printable characters byte-level BPE writes bytes as."""
    return list(byte_symbol_table().values())


def build_tokenizer(spec: str):
    """`"byte"` or a path to a tokenizer.json."""
    if spec == "byte":
        return ByteTokenizer()
    if not os.path.isfile(spec):
        raise ConfigError(f"data.tokenizer = {spec!r}: no such file; supply it (--data.tokenizer=PATH to a "
                          f"tokenizer.json) or use \"byte\" (tools/preprocess_data.py --train-tokenizer makes one)")
    try:
        # Validation and the trainer each ask for the tokenizer; a large tokenizer.json is parsed once.
        beside = generation_config(spec)
        return _load_hf(os.path.abspath(spec), os.path.getmtime(spec),
                        os.path.getmtime(beside) if os.path.isfile(beside) else None)
    except ConfigError:
        raise
    except Exception as e:  # tokenizers raises a bare Exception on bad JSON
        raise ConfigError(f"data.tokenizer = {spec!r}: not a valid tokenizer.json ({str(e).splitlines()[0]})") from None


@functools.lru_cache(maxsize=8)
def _load_hf(path: str, mtime: float, ends_mtime) -> HFTokenizer:  # mtimes: a rewritten file is loaded again
    return HFTokenizer(path)


def train_bpe(texts, vocab_size: int, out_path: str) -> HFTokenizer:
    """Train a byte-level BPE tokenizer.json on an iterable of texts with the `tokenizers` library."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=["<|endoftext|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(texts, trainer)
    os.makedirs(os.path.dirname(os.path.abspath(out_path)), exist_ok=True)
    tok.save(out_path)
    return HFTokenizer(out_path)
