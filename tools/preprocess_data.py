#!/usr/bin/env python
"""Text -> indexed token store (<prefix>.bin + <prefix>.idx) for `data.dataset`.

  python tools/preprocess_data.py --input data.jsonl --json-key text --output-prefix data/mycorpus
  python tools/preprocess_data.py --input 'docs/**/*.md' src/ --tokenizer byte --output-prefix data/docs
  python tools/preprocess_data.py --input data.jsonl --train-tokenizer --vocab-size 8192 \
      --output-prefix data/mycorpus      # also writes data/mycorpus.tokenizer.json

Inputs: .jsonl/.json files (one JSON object per line, text under --json-key), any other file as one
document, directories (walked recursively), and glob patterns. Every document ends with the
tokenizer's end-of-document token.
"""
from __future__ import annotations

import argparse
import glob
import json
import multiprocessing as mp
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from torchmeg.data.store import StoreWriter  # noqa: E402
from torchmeg.data.tokenizer import build_tokenizer, train_bpe  # noqa: E402


def expand_inputs(inputs: list[str]) -> list[str]:
    files = []
    for item in inputs:
        if os.path.isdir(item):
            for d, dirs, names in os.walk(item):
                dirs.sort()
                files += [os.path.join(d, n) for n in sorted(names)]
        elif os.path.isfile(item):
            files.append(item)
        else:
            matched = sorted(p for p in glob.glob(item, recursive=True) if os.path.isfile(p))
            if not matched:
                raise SystemExit(f"preprocess_data: --input {item!r}: no such file, directory or glob match")
            files += matched
    return files


def iter_documents(files: list[str], json_key: str):
    for path in files:
        if path.endswith((".jsonl", ".json")):
            with open(path, encoding="utf-8") as fh:
                for n, line in enumerate(fh, 1):
                    if not line.strip():
                        continue
                    try:
                        obj = json.loads(line)
                    except json.JSONDecodeError as e:
                        raise SystemExit(f"preprocess_data: {path}:{n}: not JSON ({e.msg})")
                    if json_key not in obj:
                        raise SystemExit(f"preprocess_data: {path}:{n}: no key {json_key!r}; "
                                         f"keys: {', '.join(obj)}; pass --json-key")
                    yield str(obj[json_key])
        else:
            with open(path, encoding="utf-8", errors="replace") as fh:
                yield fh.read()


_TOK = None


def _init(spec):
    global _TOK
    _TOK = build_tokenizer(spec)


def _encode(text: str):
    return list(_TOK.encode(text)) + [_TOK.eos_id]


class Progress:
    def __init__(self, total_bytes: int | None = None):
        self.t0 = self.last = time.time()
        self.docs = self.bytes = self.tokens = 0
        self.total = total_bytes

    def update(self, n_bytes: int, n_tokens: int, force: bool = False):
        self.docs += 1
        self.bytes += n_bytes
        self.tokens += n_tokens
        now = time.time()
        if force or now - self.last > 0.5:
            self.last = now
            rate = self.bytes / max(now - self.t0, 1e-9) / 2 ** 20
            pct = f" {100 * self.bytes / self.total:5.1f}% |" if self.total else ""
            print(f"\r {pct} {self.docs:,} docs | {self.bytes / 2 ** 20:,.1f} MiB | {self.tokens:,} tokens | "
                  f"{rate:.1f} MiB/s", end="", file=sys.stderr, flush=True)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--input", nargs="+", required=True, help="files, directories or glob patterns")
    ap.add_argument("--output-prefix", required=True, help="writes PREFIX.bin and PREFIX.idx")
    ap.add_argument("--json-key", default="text", help="field holding the text in .jsonl input")
    ap.add_argument("--tokenizer", default="byte", help="'byte' or a path to a tokenizer.json")
    ap.add_argument("--train-tokenizer", action="store_true", help="train a BPE tokenizer on the input first")
    ap.add_argument("--vocab-size", type=int, default=8192, help="with --train-tokenizer")
    ap.add_argument("--tokenizer-out", default=None, help="where the trained tokenizer goes "
                    "(default PREFIX.tokenizer.json)")
    ap.add_argument("--workers", type=int, default=1)
    a = ap.parse_args(argv)

    files = expand_inputs(a.input)
    total = sum(os.path.getsize(f) for f in files)
    spec = a.tokenizer
    if a.train_tokenizer:
        spec = a.tokenizer_out or a.output_prefix + ".tokenizer.json"
        print(f"training a {a.vocab_size}-token BPE tokenizer on {len(files)} file(s) ...", file=sys.stderr)
        train_bpe(iter_documents(files, a.json_key), a.vocab_size, spec)
        print(f"wrote {spec}", file=sys.stderr)
    try:
        tok = build_tokenizer(spec)
    except ValueError as e:
        raise SystemExit(f"preprocess_data: {e}")
    writer = StoreWriter(a.output_prefix, tok.vocab_size)
    prog = Progress(total if not any(f.endswith((".jsonl", ".json")) for f in files) else None)
    docs = iter_documents(files, a.json_key)
    if a.workers > 1:
        with mp.Pool(a.workers, initializer=_init, initargs=(spec,)) as pool:
            texts = []
            for text in docs:
                texts.append(text)
                if len(texts) == 256:
                    for t, ids in zip(texts, pool.map(_encode, texts)):
                        writer.add(ids)
                        prog.update(len(t.encode("utf-8")), len(ids))
                    texts = []
            for t, ids in zip(texts, pool.map(_encode, texts)):
                writer.add(ids)
                prog.update(len(t.encode("utf-8")), len(ids))
    else:
        _init(spec)
        for text in docs:
            ids = _encode(text)
            writer.add(ids)
            prog.update(len(text.encode("utf-8")), len(ids))
    writer.close()
    prog.update(0, 0, force=True)
    print(f"\nwrote {a.output_prefix}.bin/.idx: {len(writer.offsets) - 1:,} documents, {writer.offsets[-1]:,} tokens, "
          f"tokenizer {spec} ({tok.vocab_size} ids)", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
