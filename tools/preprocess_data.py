#!/usr/bin/env python
"""Text -> indexed token store (<prefix>.bin + <prefix>.idx) for `data.dataset`.

  python tools/preprocess_data.py --input data.jsonl --json-key text --output-prefix data/mycorpus
  python tools/preprocess_data.py --input 'docs/**/*.md' src/ --tokenizer byte --output-prefix data/docs
  python tools/preprocess_data.py --input data.jsonl --train-tokenizer --vocab-size 8192 \
      --output-prefix data/mycorpus      # also writes data/mycorpus.tokenizer.json

Inputs: .jsonl/.json files (one JSON object per line, text under --json-key), any other file as one
document, directories (walked recursively), and glob patterns. Every document ends with the
tokenizer's end-of-document token.

Bad input is never guessed at: a line that is not UTF-8, not JSON, not an object, or whose text is
missing, null or not a string stops the run with FILE:LINE and the reason (`--on-bad-record skip`
skips such records and counts them instead); an input with no documents is an error. Outputs
appear only when everything succeeded: nothing partial is left behind (exit 1 otherwise).
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


class BadRecord(Exception):
    """One input record that cannot become a document; the message starts with FILE:LINE."""


def _record_text(path: str, n: int, raw: bytes, json_key: str) -> str | None:
    """The text of one JSONL line (None for a blank line), or BadRecord saying why not."""
    try:
        line = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise BadRecord(f"{path}:{n}: not UTF-8 (byte {e.start} of the line)") from None
    if not line.strip():
        return None
    try:
        obj = json.loads(line)
    except json.JSONDecodeError as e:
        raise BadRecord(f"{path}:{n}: not JSON ({e.msg})") from None
    if not isinstance(obj, dict):
        raise BadRecord(f"{path}:{n}: expected a JSON object, got {type(obj).__name__}")
    if json_key not in obj:
        raise BadRecord(f"{path}:{n}: no key {json_key!r}; keys: {', '.join(obj) or '(none)'}; pass --json-key")
    text = obj[json_key]
    if not isinstance(text, str):
        what = "null" if text is None else f"a {type(text).__name__}"
        raise BadRecord(f"{path}:{n}: {json_key!r} is {what}, not a string")
    return text


def iter_documents(files: list[str], json_key: str, skipped: list | None = None):
    """Documents in order. With `skipped` (a list), bad records are appended there and skipped;
    without it the first one raises BadRecord."""
    def bad(e: BadRecord):
        if skipped is None:
            raise e
        skipped.append(str(e))

    for path in files:
        if path.endswith((".jsonl", ".json")):
            with open(path, "rb") as fh:
                for n, raw in enumerate(fh, 1):
                    try:
                        text = _record_text(path, n, raw, json_key)
                    except BadRecord as e:
                        bad(e)
                        continue
                    if text is not None:
                        yield text
        else:
            with open(path, "rb") as fh:
                data = fh.read()
            try:
                yield data.decode("utf-8")
            except UnicodeDecodeError as e:
                line = data[:e.start].count(b"\n") + 1
                bad(BadRecord(f"{path}:{line}: not UTF-8 (byte {e.start} of the file)"))


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
        self.docs += 0 if force else 1
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
    ap.add_argument("--on-bad-record", choices=["error", "skip"], default="error",
                    help="a record that is not UTF-8 / JSON / an object with a string text: stop (default) or skip it")
    a = ap.parse_args(argv)
    files = expand_inputs(a.input)
    tok_out = (a.tokenizer_out or a.output_prefix + ".tokenizer.json") if a.train_tokenizer else None
    tmp_tok = tok_out + f".{os.getpid()}.tmp" if tok_out else None
    writer = None
    try:
        writer, n_skipped = _convert(a, files, tmp_tok)
    except BaseException as e:  # noqa: BLE001 - leave nothing partial behind, whatever stopped us
        if writer is not None:
            writer.abort()
        if tmp_tok and os.path.exists(tmp_tok):
            os.remove(tmp_tok)
        if isinstance(e, (BadRecord, ValueError)):
            print(f"\npreprocess_data: {e}", file=sys.stderr)
            return 1
        raise
    if tmp_tok:
        os.replace(tmp_tok, tok_out)
    print(f"\nwrote {a.output_prefix}.bin/.idx: {len(writer.offsets) - 1:,} documents, {writer.offsets[-1]:,} tokens, "
          f"tokenizer {tok_out or a.tokenizer}" + (f"; skipped {n_skipped} bad record(s)" if n_skipped else ""),
          file=sys.stderr)
    return 0


def _convert(a, files: list[str], tmp_tok: str | None):
    """Tokenize everything into a StoreWriter; returns (closed writer, bad records skipped)."""
    total = sum(os.path.getsize(f) for f in files)
    skipped = [] if a.on_bad_record == "skip" else None
    spec = a.tokenizer
    if tmp_tok:
        print(f"training a {a.vocab_size}-token BPE tokenizer on {len(files)} file(s) ...", file=sys.stderr)
        train_bpe(iter_documents(files, a.json_key, skipped), a.vocab_size, tmp_tok)
        spec, skipped = tmp_tok, ([] if skipped is not None else None)  # the next pass counts again
    tok = build_tokenizer(spec)
    writer = StoreWriter(a.output_prefix, tok.vocab_size)
    try:
        _tokenize(a, files, spec, writer, skipped, total)
        if len(writer.offsets) == 1:
            raise BadRecord(f"no documents in {', '.join(a.input)}" + (f" ({len(skipped)} bad records skipped)"
                                                                        if skipped else ""))
        writer.close()
    except BaseException:
        writer.abort()
        raise
    for msg in (skipped or [])[:5]:
        print(f"\nskipped: {msg}", file=sys.stderr, end="")
    return writer, len(skipped or [])


def _tokenize(a, files, spec, writer, skipped, total) -> None:
    prog = Progress(total if not any(f.endswith((".jsonl", ".json")) for f in files) else None)
    docs = iter_documents(files, a.json_key, skipped)
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
    prog.update(0, 0, force=True)


if __name__ == "__main__":
    sys.exit(main())
