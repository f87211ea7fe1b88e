#!/usr/bin/env python
"""Text -> indexed token store (<prefix>.bin + <prefix>.idx) for `data.dataset`, in Megatron-LM's
indexed-dataset layout (megatron-core reads it as is; `--format torchmeg` writes torchmeg's earlier one).

  python tools/preprocess_data.py --input data.jsonl --json-key text --output-prefix data/mycorpus
  python tools/preprocess_data.py --input 'docs/**/*.md' src/ --tokenizer byte --output-prefix data/docs
  python tools/preprocess_data.py --input data.jsonl --train-tokenizer --vocab-size 8192 \
      --output-prefix data/mycorpus      # also writes data/mycorpus.tokenizer.json

Inputs: .jsonl/.json files (one JSON object per line, text under --json-key), .parquet files (the
--json-key column, read a record batch at a time; needs pyarrow: the `data` extra), any other file as one
document, directories (walked recursively), and glob patterns. Every document ends with the
tokenizer's end-of-document token (Megatron's --append-eod) and is one sequence of the index.

--workers N: N processes decode, parse and tokenize records while this one reads and writes, in
input order (the output does not depend on N). Progress on stderr: input MiB/s, tokens/s, ETA.

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

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from torchmeg.data.store import make_writer  # noqa: E402
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


def _parquet_rows(path: str, json_key: str):
    """(path, row number, text or None, "parquet") per row of a Parquet file's --json-key column, read
    a record batch at a time (FineWeb / DCLM shards are GBs); a damaged file or a missing column is a
    BadRecord naming the file."""
    try:
        import pyarrow.parquet as pq
    except ImportError:
        raise BadRecord(f"{path}: reading Parquet needs pyarrow (pip install -e '.[data]')") from None
    try:
        f = pq.ParquetFile(path)
        if json_key not in f.schema_arrow.names:
            raise BadRecord(f"{path}: no column {json_key!r}; columns: {', '.join(f.schema_arrow.names)}; "
                            f"pass --json-key")
        row = 0
        for batch in f.iter_batches(columns=[json_key], batch_size=1024):
            for text in batch.column(0).to_pylist():
                row += 1
                yield path, row, text, "parquet"
    except BadRecord:
        raise
    except Exception as e:  # pyarrow raises several types for damaged files
        raise BadRecord(f"{path}: not a readable Parquet file ({type(e).__name__}: {e})") from None


def iter_records(files: list[str], json_key: str = "text"):
    """(path, line number, raw bytes, is_jsonl) per record, in order: a JSONL line, or a whole file;
    Parquet rows carry their text (kind "parquet"). Cheap: the workers decode, parse and tokenize."""
    for path in files:
        if path.endswith(".parquet"):
            yield from _parquet_rows(path, json_key)
        elif path.endswith((".jsonl", ".json")):
            with open(path, "rb") as fh:
                for n, raw in enumerate(fh, 1):
                    yield path, n, raw, True
        else:
            with open(path, "rb") as fh:
                yield path, 1, fh.read(), False


def record_text(record, json_key: str) -> str | None:
    """A record's text (None: a blank line), or BadRecord saying why not."""
    path, n, raw, is_jsonl = record
    if is_jsonl == "parquet":
        if raw is None:
            return None  # a null cell: no document (as a blank JSONL line)
        if not isinstance(raw, str):
            raise BadRecord(f"{path}:row {n}: {json_key!r} is a {type(raw).__name__}, not a string")
        return raw
    if is_jsonl:
        return _record_text(path, n, raw, json_key)
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as e:
        line = raw[:e.start].count(b"\n") + 1
        raise BadRecord(f"{path}:{line}: not UTF-8 (byte {e.start} of the file)") from None


def iter_documents(files: list[str], json_key: str, skipped: list | None = None):
    """Document texts in order (tokenizer training). With `skipped` (a list), bad records are
    appended there and skipped; without it the first one raises BadRecord."""
    for rec in iter_records(files, json_key):
        try:
            text = record_text(rec, json_key)
        except BadRecord as e:
            if skipped is None:
                raise
            skipped.append(str(e))
            continue
        if text is not None:
            yield text


_TOK, _KEY = None, "text"


def _init(spec, json_key):
    global _TOK, _KEY
    _TOK, _KEY = build_tokenizer(spec), json_key


def _work(record):
    """In a worker: -> ("doc", token ids, input bytes) | ("skip", None, input bytes) |
    ("bad", message, input bytes)."""
    size = len(record[2].encode("utf-8")) if isinstance(record[2], str) else len(record[2] or b"")
    try:
        text = record_text(record, _KEY)
    except BadRecord as e:
        return "bad", str(e), size
    if text is None:
        return "skip", None, size
    ids = _TOK.encode_np(text)  # (an array: pickled back to the reader far faster than a list)
    return "doc", np.append(ids, _TOK.eos_id).astype(np.int32), size


class Progress:
    """Input MiB/s, tokens/s and ETA (from the input bytes read), twice a second on stderr."""

    def __init__(self, total_bytes: int):
        self.t0 = self.last = time.time()
        self.docs = self.bytes = self.tokens = 0
        self.total = total_bytes

    def update(self, n_bytes: int, n_tokens: int, docs: int = 1, force: bool = False):
        self.docs += docs
        self.bytes += n_bytes
        self.tokens += n_tokens
        now = time.time()
        if force or now - self.last > 0.5:
            self.last = now
            dt = max(now - self.t0, 1e-9)
            left = (self.total - self.bytes) / (self.bytes / dt) if self.bytes else float("nan")
            pct = 100 * self.bytes / self.total if self.total else 100.0
            print(f"\r {pct:5.1f}% | {self.docs:,} docs | {self.tokens:,} tokens | {self.bytes / dt / 2 ** 20:.1f} MiB/s "
                  f"| {self.tokens / dt:,.0f} tokens/s | ETA {left:.0f} s   ", end="", file=sys.stderr, flush=True)

    def summary(self) -> str:
        dt = max(time.time() - self.t0, 1e-9)
        return f"{self.tokens / dt:,.0f} tokens/s ({self.bytes / dt / 2 ** 20:.1f} MiB/s of input) in {dt:.1f} s"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--input", nargs="+", required=True, help="files, directories or glob patterns")
    ap.add_argument("--output-prefix", required=True, help="writes PREFIX.bin and PREFIX.idx")
    ap.add_argument("--json-key", "--text-key", default="text", help="field (column) holding the text in .jsonl "
                    "(.parquet) input")
    ap.add_argument("--tokenizer", default="byte", help="'byte' or a path to a tokenizer.json")
    ap.add_argument("--train-tokenizer", action="store_true", help="train a BPE tokenizer on the input first")
    ap.add_argument("--vocab-size", type=int, default=8192, help="with --train-tokenizer")
    ap.add_argument("--tokenizer-out", default=None, help="where the trained tokenizer goes "
                    "(default PREFIX.tokenizer.json)")
    ap.add_argument("--workers", type=int, default=1, help="tokenizing processes")
    ap.add_argument("--format", choices=["megatron", "torchmeg"], default="megatron",
                    help="megatron: Megatron-LM's indexed dataset (default); torchmeg: torchmeg's earlier layout")
    ap.add_argument("--on-bad-record", choices=["error", "skip"], default="error",
                    help="a record that is not UTF-8 / JSON / an object with a string text: stop (default) or skip it")
    a = ap.parse_args(argv)
    files = expand_inputs(a.input)
    tok_out = (a.tokenizer_out or a.output_prefix + ".tokenizer.json") if a.train_tokenizer else None
    tmp_tok = tok_out + f".{os.getpid()}.tmp" if tok_out else None
    writer = None
    try:
        writer, n_skipped, rate = _convert(a, files, tmp_tok)
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
    print(f"\nwrote {a.output_prefix}.bin/.idx ({a.format}): {writer.n_docs:,} documents, {writer.n_tokens:,} tokens, "
          f"tokenizer {tok_out or a.tokenizer}; {rate}" + (f"; skipped {n_skipped} bad record(s)" if n_skipped else ""),
          file=sys.stderr)
    return 0


def _input_bytes(path: str, json_key: str) -> int:
    """What the progress line counts through: a file's size, or a Parquet column's uncompressed size
    (the text the rows hold, which the compressed file size understates)."""
    if path.endswith(".parquet"):
        try:
            import pyarrow.parquet as pq
            meta = pq.ParquetFile(path).metadata
            cols = [i for i in range(meta.num_columns) if meta.schema.column(i).name == json_key]
            return sum(meta.row_group(g).column(c).total_uncompressed_size
                       for g in range(meta.num_row_groups) for c in cols) or os.path.getsize(path)
        except Exception:  # unreadable: reading it reports that, naming the file
            return os.path.getsize(path)
    return os.path.getsize(path)


def _convert(a, files: list[str], tmp_tok: str | None):
    """Tokenize everything into a StoreWriter; returns (closed writer, bad records skipped)."""
    total = sum(_input_bytes(f, a.json_key) for f in files)
    skipped = [] if a.on_bad_record == "skip" else None
    spec = a.tokenizer
    if tmp_tok:
        print(f"training a {a.vocab_size}-token BPE tokenizer on {len(files)} file(s) ...", file=sys.stderr)
        train_bpe(iter_documents(files, a.json_key, skipped), a.vocab_size, tmp_tok)
        spec, skipped = tmp_tok, ([] if skipped is not None else None)  # the next pass counts again
    tok = build_tokenizer(spec)
    writer = make_writer(a.output_prefix, tok.vocab_size, a.format)
    try:
        rate = _tokenize(a, files, spec, writer, skipped, total)
        if writer.n_docs == 0:
            raise BadRecord(f"no documents in {', '.join(a.input)}" + (f" ({len(skipped)} bad records skipped)"
                                                                        if skipped else ""))
        writer.close()
    except BaseException:
        writer.abort()
        raise
    for msg in (skipped or [])[:5]:
        print(f"\nskipped: {msg}", file=sys.stderr, end="")
    return writer, len(skipped or []), rate


def _tokenize(a, files, spec, writer, skipped, total) -> str:
    """Records -> documents in the writer, in input order; -> the throughput line."""
    prog = Progress(total)
    records = iter_records(files, a.json_key)
    if a.workers > 1:
        pool = mp.Pool(a.workers, initializer=_init, initargs=(spec, a.json_key))
        results = pool.imap(_work, records, chunksize=16)  # streamed, in order
    else:
        pool = None
        _init(spec, a.json_key)
        results = map(_work, records)
    try:
        for kind, payload, size in results:
            if kind == "bad":
                if skipped is None:
                    raise BadRecord(payload)
                skipped.append(payload)
                prog.update(size, 0, docs=0)
            elif kind == "skip":
                prog.update(size, 0, docs=0)
            else:
                writer.add(payload)
                prog.update(size, len(payload))
    finally:
        if pool is not None:
            pool.terminate()
    prog.update(0, 0, docs=0, force=True)
    return prog.summary()


if __name__ == "__main__":
    sys.exit(main())
