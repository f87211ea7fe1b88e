"""Tokenizers, the indexed store, preprocessing, and layout-independent sample order."""
import json
import os
import subprocess
import sys

import numpy as np
import pytest

from torchmeg.data.dataset import StepSampler, TokenDataset
from torchmeg.data.sources import build_stdlib, stdlib_files
from torchmeg.data.store import Store, StoreWriter, open_store
from torchmeg.data.tokenizer import ByteTokenizer, build_tokenizer, train_bpe

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TEXTS = ["def f(x):\n    return x + 1\n", "héllo wörld ✓", "", "class A:\n    pass\n" * 20]


def test_byte_tokenizer_round_trip():
    tok = ByteTokenizer()
    for t in TEXTS:
        assert tok.decode(tok.encode(t)) == t
    assert max(tok.encode("ÿ✓")) < 256 and tok.eos_id == 256 and tok.vocab_size == 257


def test_bpe_train_and_round_trip(tmp_path):
    tok = train_bpe(TEXTS * 50 + [open(f).read() for f in stdlib_files()[:20]], 400, str(tmp_path / "tok.json"))
    assert tok.vocab_size <= 401
    for t in TEXTS:
        assert tok.decode(tok.encode(t)) == t
    assert len(tok.encode(TEXTS[3])) < len(TEXTS[3])  # it learned merges
    again = build_tokenizer(str(tmp_path / "tok.json"))
    assert again.encode(TEXTS[0]) == tok.encode(TEXTS[0])


def test_store_round_trip(tmp_path):
    docs = [np.arange(n) % 300 for n in (5, 0, 17, 1)]
    w = StoreWriter(str(tmp_path / "s"), vocab_size=300)
    for d in docs:
        w.add(d)
    w.close()
    s = Store(str(tmp_path / "s"))
    assert s.n_docs == 4 and s.n_tokens == 23 and s.vocab_size == 300 and s.dtype == np.uint16
    for i, d in enumerate(docs):
        assert np.array_equal(s.doc(i), d)
    big = StoreWriter(str(tmp_path / "b"), vocab_size=100000)
    big.add([99999, 70000])
    big.close()
    assert list(Store(str(tmp_path / "b")).doc(0)) == [99999, 70000]


@pytest.mark.slow
def test_preprocess_jsonl_and_trained_bpe(tmp_path):
    src = tmp_path / "in.jsonl"
    src.write_text("\n".join(json.dumps({"body": t, "id": i}) for i, t in enumerate(TEXTS)) + "\n")
    run = lambda *a: subprocess.run([sys.executable, os.path.join(ROOT, "tools", "preprocess_data.py"), *a],
                                    capture_output=True, text=True, timeout=120)
    p = run("--input", str(src), "--json-key", "body", "--output-prefix", str(tmp_path / "byte"), "--workers", "2")
    assert p.returncode == 0, p.stderr
    s, tok = open_store(str(tmp_path / "byte")), ByteTokenizer()
    assert s.n_docs == len(TEXTS)
    for i, t in enumerate(TEXTS):
        assert tok.decode(s.doc(i)[:-1]) == t and s.doc(i)[-1] == tok.eos_id
    p = run("--input", str(src), "--json-key", "body", "--output-prefix", str(tmp_path / "bpe"),
            "--train-tokenizer", "--vocab-size", "300")
    assert p.returncode == 0, p.stderr
    bpe = build_tokenizer(str(tmp_path / "bpe.tokenizer.json"))
    s = open_store(str(tmp_path / "bpe"))
    assert s.format == "megatron" and s.vocab_size is None  # Megatron's index does not record it
    assert bpe.decode(s.doc(0)[:-1]) == TEXTS[0]
    p = run("--input", str(src), "--json-key", "text", "--output-prefix", str(tmp_path / "x"))
    assert p.returncode != 0 and "--json-key" in p.stderr


@pytest.fixture(scope="module")
def stdlib_store():
    return open_store(build_stdlib(ByteTokenizer()))


@pytest.mark.slow
def test_preprocess_parquet_equals_jsonl_and_damage_is_named(tmp_path):
    """--input *.parquet --text-key: the same store as the same texts in JSON lines (null cells are no
    document); a damaged Parquet file or a missing column stops with one line naming the file."""
    import pyarrow as pa
    import pyarrow.parquet as pq
    run = lambda *a: subprocess.run([sys.executable, os.path.join(ROOT, "tools", "preprocess_data.py"), *a],
                                    capture_output=True, text=True, timeout=120)
    (tmp_path / "in.jsonl").write_text("\n".join(json.dumps({"body": t}) for t in TEXTS) + "\n")
    pq.write_table(pa.table({"body": TEXTS[:2] + [None] + TEXTS[2:], "n": list(range(len(TEXTS) + 1))}),
                   str(tmp_path / "in.parquet"), row_group_size=2)
    for name, src, extra in (("j", "in.jsonl", []), ("p", "in.parquet", ["--workers", "2"])):
        p = run("--input", str(tmp_path / src), "--text-key", "body", "--output-prefix", str(tmp_path / name), *extra)
        assert p.returncode == 0, p.stderr
    assert (tmp_path / "j.bin").read_bytes() == (tmp_path / "p.bin").read_bytes()
    assert (tmp_path / "j.idx").read_bytes() == (tmp_path / "p.idx").read_bytes()
    (tmp_path / "bad.parquet").write_bytes((tmp_path / "in.parquet").read_bytes()[:-40])  # footer cut off
    for args, why in ((["--input", str(tmp_path / "bad.parquet")], "not a readable Parquet file"),
                      (["--input", str(tmp_path / "in.parquet"), "--text-key", "text"], "no column 'text'")):
        p = run(*args, "--output-prefix", str(tmp_path / "out"))
        lines = [x for x in p.stderr.splitlines() if x.strip()]
        assert p.returncode == 1 and len(lines) == 1 and why in lines[0] and ".parquet" in lines[0], p.stderr
        assert not (tmp_path / "out.bin").exists()  # nothing partial left


def test_stdlib_corpus_is_real_text(stdlib_store):
    assert stdlib_store.n_tokens > 5_000_000  # the stdlib's own source, several MB
    text = ByteTokenizer().decode(stdlib_store.doc(0))
    assert "import" in text or "def " in text
    assert not any("/test/" in f or "site-packages" in f for f in stdlib_files())


def _step_samples(ds, B, dp, accum, step):
    """All sample contents a step sees, over all dp ranks and microbatches."""
    out = []
    for r in range(dp):
        idx = list(StepSampler(B, dp, r, accum, step, step + 1))
        out += [tuple(ds[i][0].tolist()) for i in idx]
    return sorted(out)


def test_sample_order_is_layout_independent(stdlib_store):
    ds = TokenDataset([stdlib_store], [], seq_len=32, seed=5)
    for step in (0, 3):
        ref = _step_samples(ds, B=8, dp=1, accum=1, step=step)
        assert _step_samples(ds, B=4, dp=2, accum=1, step=step) == ref
        assert _step_samples(ds, B=2, dp=2, accum=2, step=step) == ref
        assert _step_samples(ds, B=1, dp=4, accum=2, step=step) == ref
    assert _step_samples(ds, 8, 1, 1, 0) != _step_samples(ds, 8, 1, 1, 1)
    other = TokenDataset([stdlib_store], [], seq_len=32, seed=6)
    assert other[0][0].tolist() != ds[0][0].tolist()


def test_labels_shift_and_val_split_disjoint(stdlib_store):
    tr = TokenDataset([stdlib_store], [], seq_len=16, seed=0, split="train", val_fraction=0.01)
    va = TokenDataset([stdlib_store], [], seq_len=16, seed=0, split="val", val_fraction=0.01)
    x, y = tr[7]
    assert x.shape == (16,) and y.shape == (16,) and x[1:].tolist() == y[:-1].tolist()
    # Train windows end where validation windows begin; validation is read in a fixed order.
    assert tr.src.w.first == 0 and tr.src.w.first + tr.src.w.n == va.src.w.first
    assert va.src.w.n == int(((stdlib_store.n_tokens - 1) // 16) * 0.01)
    start = va.src.w.first * 16
    assert va[0][0].tolist() == stdlib_store.tokens[start:start + 16].astype(np.int64).tolist()


def test_blending_follows_weights(tmp_path):
    prefixes = []
    for k in range(2):
        w = StoreWriter(str(tmp_path / f"s{k}"), vocab_size=300)
        w.add(np.full(10_000, k + 1))
        w.close()
        prefixes.append(Store(str(tmp_path / f"s{k}")))
    ds = TokenDataset(prefixes, [3.0, 1.0], seq_len=8, seed=0, val_fraction=0.0)
    firsts = [int(ds[i][0][0]) for i in range(4096)]
    share = firsts.count(1) / len(firsts)
    assert abs(share - 0.75) < 0.01
    assert [int(ds[i][0][0]) for i in range(50)] == firsts[:50]  # deterministic on re-read
