"""Data for real corpora: Megatron's indexed datasets both ways (checked against megatron-core's own
reader and builder), document-aware samples under every layout, and a shuffle that scales."""
import json
import os
import subprocess
import sys
import tracemalloc
import warnings

import numpy as np
import pytest
import torch

from conftest import FP32_PARITY, TINY, assert_parity, assert_tensor_close, read_metrics
from launch import ROOT, launch_ranks, run_cli
from torchmeg.config.schema import load_config
from torchmeg.data.dataset import IGNORE, PackedWindows, Shuffled, TokenDataset
from torchmeg.data.shuffle import Permutation
from torchmeg.data.store import open_store
from torchmeg.config.errors import ConfigError
from torchmeg.train.validate import validate


def _mcore():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # (megatron-core warns that Transformer Engine / Apex are absent)
        from megatron.core.datasets import indexed_dataset as mc
    return mc


def _docs(n_docs=40, seed=0, vocab=257, eos=256):
    """Documents of 1-3 'sentences' each (Megatron's sequences), the last ending with EOS."""
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(n_docs):
        sents = [rng.integers(0, vocab - 1, rng.integers(3, 40)) for _ in range(rng.integers(1, 4))]
        sents[-1] = np.append(sents[-1], eos)
        out.append(sents)
    return out


def _mcore_store(prefix, dtype, docs):
    mc = _mcore()
    b = mc.IndexedDatasetBuilder(f"{prefix}.bin", dtype=dtype)
    for sents in docs:
        for s in sents:
            b.add_item(torch.tensor(s))
        b.end_document()
    b.finalize(f"{prefix}.idx")
    return mc.IndexedDataset(str(prefix))


# ---- Megatron's format -----------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", [np.uint16, np.int32, np.uint8, np.int8, np.int16, np.int64, np.float32, np.float64])
def test_megatron_core_store_reads_identically(dtype, tmp_path):
    """Every dtype code megatron-core writes: the same tokens per document (sequences joined), the
    document starts from the index, and windows over the same stream."""
    vocab = 120 if dtype in (np.uint8, np.int8) else 257
    docs = _docs(vocab=vocab, eos=vocab - 1)
    ref = _mcore_store(tmp_path / "m", dtype, docs)
    s = open_store(str(tmp_path / "m"))
    assert s.format == "megatron" and s.n_docs == len(docs) == len(ref.document_indices) - 1
    stream = np.concatenate([ref[i] for i in range(len(ref))]).astype(np.int64)
    assert np.array_equal(np.asarray(s.tokens, dtype=np.int64), stream)
    for d in range(len(docs)):
        a, b = ref.document_indices[d], ref.document_indices[d + 1]
        assert np.array_equal(s.doc(d), np.concatenate([ref[i] for i in range(a, b)]))
    starts = np.cumsum([0] + [sum(len(x) for x in sents) for sents in docs])[:-1]
    assert np.array_equal(s.doc_starts(0, s.n_tokens), starts)
    assert np.array_equal(s.doc_starts(int(starts[3]) + 1, int(starts[7]) + 1), starts[4:8])


def _text_docs():
    """Real text (the json package's source), a document per file, a sequence per line."""
    import json as js
    lib = os.path.dirname(js.__file__)
    docs = []
    for f in sorted(os.listdir(lib)):
        if f.endswith(".py"):
            lines = [np.frombuffer(line.encode(), np.uint8).astype(np.int64) for line in open(os.path.join(lib, f))]
            lines[-1] = np.append(lines[-1], 256)
            docs.append(lines)
    return docs


@pytest.mark.slow
def test_megatron_core_store_trains(tmp_path):
    """Stores megatron-core's builder wrote (uint16 and int32) train through --data.dataset=PREFIX."""
    for dtype in (np.uint16, np.int32):
        _mcore_store(tmp_path / f"m_{np.dtype(dtype).name}", dtype, _text_docs())
        run_cli(TINY + ["--training.steps=12", f"--data.dataset={tmp_path / f'm_{np.dtype(dtype).name}'}",
                        "--data.document_masking=true"], tmp_path, name=np.dtype(dtype).name)
        rows = read_metrics(tmp_path, np.dtype(dtype).name)
        assert rows[-1]["loss"] < rows[0]["loss"] - 0.3


@pytest.mark.slow
def test_preprocess_writes_what_megatron_core_reads(tmp_path):
    texts = ["def f(x):\n    return x\n", "class A:\n    pass\n", "ünïcödé ✓\n" * 3, "x = 1"]
    src = tmp_path / "in.jsonl"
    src.write_text("\n".join(json.dumps({"text": t}) for t in texts) + "\n")
    for workers in ("1", "2"):
        p = subprocess.run([sys.executable, "tools/preprocess_data.py", "--input", str(src), "--output-prefix",
                            str(tmp_path / f"w{workers}"), "--format", "megatron", "--workers", workers],
                           cwd=ROOT, capture_output=True, text=True, timeout=120)
        assert p.returncode == 0, p.stderr
        assert "tokens/s" in p.stderr and "ETA" in p.stderr, p.stderr
    ref = _mcore().IndexedDataset(str(tmp_path / "w1"))
    assert len(ref) == len(texts) and list(ref.document_indices) == list(range(len(texts) + 1))
    for i, t in enumerate(texts):
        assert bytes(ref[i][:-1].astype(np.uint8)).decode() == t and ref[i][-1] == 256 and ref[i].dtype == np.uint16
    assert open(tmp_path / "w1.bin", "rb").read() == open(tmp_path / "w2.bin", "rb").read()  # workers: same bytes
    assert open(tmp_path / "w1.idx", "rb").read() == open(tmp_path / "w2.idx", "rb").read()


def _damage(prefix, how):
    b, i = f"{prefix}.bin", f"{prefix}.idx"
    S = 40
    if how == "truncate_bin":
        os.truncate(b, os.path.getsize(b) - 4)
    elif how == "truncate_idx":
        os.truncate(i, os.path.getsize(i) - 8)
    elif how == "multimodal":
        open(i, "ab").write(b"\0" * S)
    elif how in ("magic", "version", "dtype", "pointers", "doc_index"):
        at = {"magic": 0, "version": 9, "dtype": 17, "pointers": 34 + 4 * S + 8 * 5, "doc_index": 34 + 12 * S + 8 * 3}[how]
        val = {"magic": b"XX", "version": np.uint64(2).tobytes(), "dtype": b"\x09",
               "pointers": np.int64(7).tobytes(), "doc_index": np.int64(10 ** 6).tobytes()}[how]
        with open(i, "r+b") as fh:
            fh.seek(at)
            fh.write(val)
    else:  # ids beyond the tokenizer's vocabulary
        with open(b, "r+b") as fh:
            fh.seek(20)
            fh.write(np.uint16(9999).tobytes())


@pytest.mark.parametrize("how, words", [
    ("truncate_bin", "the pair does not belong together or was cut short"), ("truncate_idx", "truncated"),
    ("multimodal", "multimodal"), ("magic", "is neither Megatron's"), ("version", "version 2"),
    ("dtype", "unknown token dtype code 9"), ("pointers", "not back to back"), ("doc_index", "document indices"),
    ("ids", "outside the vocabulary"),
])
def test_damaged_megatron_store_is_named_in_one_line(how, words, tmp_path):
    docs = [[np.arange(5) % 250, np.append(np.arange(7) % 250, 256)] for _ in range(20)]  # 40 sequences
    _mcore_store(tmp_path / "m", np.uint16, docs)
    _damage(tmp_path / "m", how)
    cfg = load_config(None, TINY + [f"--data.dataset={tmp_path / 'm'}"])
    with pytest.raises(ConfigError) as e:
        validate(cfg, 1)
    msg = str(e.value)
    assert "\n" not in msg and str(tmp_path / "m") in msg and words in msg, msg


# ---- document-aware samples ------------------------------------------------------------------------

def test_samples_carry_documents_and_mask_the_eod_target(tmp_path):
    docs = [[np.full(n, k + 1)] for k, n in enumerate((5, 9, 30))]
    _mcore_store(tmp_path / "m", np.uint16, docs)
    s = open_store(str(tmp_path / "m"))
    ds = TokenDataset([s], [], seq_len=20, seed=0, split="all", val_fraction=0.0, documents=True, mask_eod=True)
    x, y, d = ds[0]  # tokens 0..19: 5 of doc 0, 9 of doc 1, 6 of doc 2
    assert d.tolist() == [0] * 5 + [1] * 9 + [2] * 6
    assert x.tolist() == [1] * 5 + [2] * 9 + [3] * 6
    assert [i for i, v in enumerate(y.tolist()) if v == IGNORE] == [4, 13]  # next token starts another document
    plain = TokenDataset([s], [], seq_len=20, seed=0, split="all", val_fraction=0.0)
    assert len(plain[0]) == 2 and plain[0][1].tolist()[4] == 2


LAYOUTS = ["single", "tp2", "cp2_allgather", "cp2_alltoall", "pp2"]


@pytest.mark.slow
@pytest.mark.parametrize("layout", LAYOUTS)
def test_packed_documents_equal_each_document_alone(layout):
    """A window packing documents A|B|C, through the real build and microbatch loop / pipeline
    schedule of each layout: every token's loss equals running its document alone on one process,
    within the fp32 parity rule (conftest: relative 1e-5; sums in another order). Without masking the packed row is a
    different computation (loss differences of ~1), so the check sees the masking."""
    from doc_mask_worker import LAYOUTS as WORKER
    p = launch_ranks([sys.executable, "tests/doc_mask_worker.py", layout], WORKER[layout][0], dict(os.environ), 120)
    assert p.returncode == 0, p.stderr[-3000:]
    r = json.loads(p.stdout.strip().splitlines()[-1])
    assert r["max_rel_diff"] <= FP32_PARITY and r["dense_diff"] > 0.1, r


@pytest.mark.slow
@pytest.mark.parametrize("name, nproc, layout", [
    ("fsdp2", 2, ["--parallelism.data_parallel_shard_degree=2", "--training.local_batch_size=2"]),
    ("tp2", 2, ["--parallelism.tensor_parallel_degree=2", "--parallelism.data_parallel_shard_degree=1"]),
])
def test_document_masking_trains_alike_in_every_layout(name, nproc, layout, short_docs, tmp_path):
    """The trainer with document masking and the end-of-document target masked, on short documents:
    FSDP2 and TP2 (SP, loss parallel) equal one process step by step (1e-5)."""
    args = TINY + ["--training.steps=6", "--training.deterministic=true", "--training.global_batch_size=4",
                   f"--data.dataset={short_docs}", "--data.document_masking=true", "--data.mask_eod_loss=true"]
    run_cli(args + ["--training.local_batch_size=4"], tmp_path, name="ref")
    run_cli(args + layout, tmp_path, nproc=nproc, name=name)
    assert_parity(read_metrics(tmp_path, "ref"), read_metrics(tmp_path, name))


def test_document_masking_refusals():
    with pytest.raises(ConfigError, match="context_parallel_mode = \"ring\" with data.document_masking"):
        validate(load_config(None, TINY + ["--data.document_masking=true", "--parallelism.context_parallel_degree=2",
                                           "--parallelism.context_parallel_mode=ring"]), 2)
    with pytest.raises(ConfigError, match="data.document_masking = true: masks attention in torchmeg's own"):
        validate(load_config("recipes/hf_llama_debug.toml", ["--data.document_masking=true"]), 1)


# ---- the shuffle ------------------------------------------------------------------------------------

@pytest.mark.parametrize("n", [1, 2, 3, 1000, 4097, 65536, 999_983, 1 << 20])
def test_shuffle_hits_every_index_once(n):
    p = Permutation(n, key=12345)
    out = p.many(np.arange(n, dtype=np.uint64))
    assert np.array_equal(np.sort(out), np.arange(n))
    assert all(p(i) == int(out[i]) and p.inverse(int(out[i])) == i for i in range(0, n, max(1, n // 97)))
    if n >= 1000:  # and it shuffles: few fixed points, neighbours land far apart
        assert (out == np.arange(n)).mean() < 0.01 and np.abs(np.diff(out.astype(np.int64))).mean() > n / 10


@pytest.mark.parametrize("n", [(1 << 32) + 15, 10 ** 10, (1 << 62) - 57])
def test_shuffle_is_a_bijection_beyond_2_to_32(n):
    """Too many to enumerate: images of 20,000 spread indices are distinct, inside [0, n), and map
    back (an injection of a finite set into itself is onto), and 2,000 targets have preimages."""
    p = Permutation(n, key=7)
    idx = [k * (n // 20000) for k in range(20000)] + [n - 1]
    images = [p(i) for i in idx]
    assert len(set(images)) == len(set(idx)) and all(0 <= j < n for j in images)
    assert all(p.inverse(j) == i for i, j in zip(idx, images))
    targets = [k * (n // 2000) + 1 for k in range(2000)]
    assert all(p(p.inverse(t)) == t for t in targets)


class _Virtual:
    """n windows that cost nothing: what Shuffled sees of a store, without one."""

    def __init__(self, n):
        self.n = n

    def __len__(self):
        return self.n

    def window(self, j):
        return j


def test_loader_memory_is_flat_in_the_number_of_windows():
    """10^10 windows (about 80T tokens at seq 8192): reading samples allocates what 10^4 windows
    do; the permutation it replaced would have been 80 GB."""
    peaks = {}
    for n in (10 ** 4, 10 ** 10):
        s = Shuffled(_Virtual(n), seed=3)
        tracemalloc.start()
        got = [s.get(i) for i in list(range(500)) + list(range(n - 500, n))]
        peaks[n] = tracemalloc.get_traced_memory()[1]
        tracemalloc.stop()
        assert len(set(got)) == 1000 and all(0 <= g < n for g in got)
    # (the peak is the 1000 indices and samples read themselves, ~70 KB at either size)
    assert peaks[10 ** 10] < 1 << 20 and peaks[10 ** 10] < 1.5 * peaks[10 ** 4] + 16 * 1024, peaks


def test_windows_of_a_store_read_through_the_shuffle(tmp_path):
    """Sample i of an epoch is window perm(i); epochs are different permutations of the same windows."""
    _mcore_store(tmp_path / "m", np.uint16, _docs(n_docs=300, seed=2))
    s = open_store(str(tmp_path / "m"))
    w = PackedWindows(s, 16, "all", 0.0)
    sh = Shuffled(w, seed=5)
    n = len(w)
    first = [sh.index(i) for i in range(n)]
    second = [sh.index(n + i) for i in range(n)]
    assert sorted(first) == sorted(second) == list(range(n)) and first != second


@pytest.mark.parametrize("q_start, L, heads", [(0, 200, (4, 2)), (72, 64, (4, 4))], ids=["window_gqa", "cp_chunk"])
def test_flex_document_mask_equals_the_sdpa_path(q_start, L, heads, monkeypatch):
    """The CUDA path (FlexAttention, its block mask built on the device from the document numbers)
    run forward on CPU (it has no CPU backward) equals the SDPA path piece by piece: rows of one,
    three and many documents, a document boundary inside a 128-token block, GQA, and a
    context-parallel query chunk starting inside a document (q_start > 0). fp32 SDPA vs flex sum the
    same products in another order: the fp32 parity rule. Without the mask (plain causal) the
    outputs differ by ~1, so the check sees the masking."""
    from torchmeg.models.attention import DocumentBatch, document_attention
    from torchmeg.parallel.compile import isa_cache_dir
    # inductor compiles the flex kernel, and its cache does not key on the ISA ATen runs with: CI's
    # AVX2 pass read the first pass's kernels and got other numbers. One cache per ISA, as the trainer keeps.
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", isa_cache_dir(os.environ.get("TORCHINDUCTOR_CACHE_DIR", "")))
    torch.manual_seed(0)
    S, (H, K), D = 200, heads, 32
    docs = torch.zeros(3, S, dtype=torch.int64)
    docs[1, 90:], docs[1, 130:] = 1, 2                      # three documents, one ending mid-block
    docs[2] = torch.arange(S) // 7                          # many short ones
    q = torch.randn(3, H, L, D)
    k, v = torch.randn(3, K, S, D), torch.randn(3, K, S, D)
    batch = DocumentBatch(docs)
    flex = document_attention(q, k, v, batch, q_start, flex=True)
    sdpa = document_attention(q, k, v, docs, q_start)
    assert_tensor_close(flex, sdpa, FP32_PARITY, "flex vs sdpa")
    assert batch.block_mask(L, q_start) is batch.block_mask(L, q_start)  # built once per forward, every layer
    causal = torch.nn.functional.scaled_dot_product_attention(
        q, k.repeat_interleave(H // K, 1), v.repeat_interleave(H // K, 1),
        attn_mask=torch.ones(L, S, dtype=torch.bool).tril(q_start))
    assert (causal[1:] - sdpa[1:]).abs().max() > 0.1


def test_op_recorder_records_flex_attention(monkeypatch):
    """TORCHMEG_RECORD_OPS's recorder (a dispatch mode) over the flex path: torch.compile skips every
    frame under such a mode and torch 2.13's eager flex_attention is a fullgraph compile ("found no
    compiled frames"); on torch 2.11 the op reached the mode with no rule for it, and our compiled
    kernel entered under the mode failed. Found on an H200, where every recorded run of the debug
    recipe failed at step 1. Recorded, flex runs as the plain op, not our compiled kernel: the same
    output, its operands' dtype recorded, torch's flag put back."""
    import torch.nn.attention.flex_attention as flex_module
    from torchmeg.models.attention import DocumentBatch, document_attention
    from torchmeg.observe.op_record import OpRecorder
    from torchmeg.parallel.compile import isa_cache_dir
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", isa_cache_dir(os.environ.get("TORCHINDUCTOR_CACHE_DIR", "")))
    torch.manual_seed(0)
    docs = torch.arange(128).div(40, rounding_mode="floor")[None]
    q, k, v = (torch.randn(1, 2, 128, 16, dtype=torch.bfloat16) for _ in range(3))
    plain = document_attention(q, k, v, DocumentBatch(docs), 0, flex=True)
    before = flex_module._FLEX_ATTENTION_DISABLE_COMPILE_DEBUG
    # recorded, our compiled kernel is not entered: on torch 2.11 (an H200, 2026-11-29) it failed under
    # the mode, dynamo tracing flex's dense reference to `torch._safe_softmax` (torch 2.13 skips it)
    from torchmeg.models import flex_documents

    def compiled_kernel():
        raise AssertionError("the compiled flex kernel was entered under the op recorder")
    monkeypatch.setattr(flex_documents, "_kernel", compiled_kernel)
    recorder = OpRecorder()
    with recorder:
        recorded = document_attention(q, k, v, DocumentBatch(docs), 0, flex=True)
    assert flex_module._FLEX_ATTENTION_DISABLE_COMPILE_DEBUG == before
    assert recorder.matmul.get("flex_attention") == {"bfloat16"}, recorder.matmul
    # the compiled kernel vs the plain op in bf16: 8 mantissa bits, sums of 128 products -> 2^-8 relative
    assert_tensor_close(recorded.float(), plain.float(), 2 ** -8 * 4, "recorded vs plain flex")
