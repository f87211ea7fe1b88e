"""Damaged inputs: checkpoints, data stores and preprocessing records. Each case ends in one line
naming the file, or in the documented fallback — never garbage loaded, never a silent exit 0."""
import json
import os
import shutil
import subprocess
import sys
import zlib

import numpy as np
import pytest

from conftest import TINY, assert_resumed, read_metrics
from launch import ROOT, run_cli

P = "--parallelism."
BASE = TINY + ["--training.steps=8", "--training.deterministic=true", "--checkpoint.enable=true",
               "--checkpoint.interval=4", "--checkpoint.keep_latest_k=0"]


def ck_folder(tmp_path, name="run"):
    return tmp_path / name / "checkpoint"


@pytest.fixture(scope="module")
def pristine(tmp_path_factory):
    """One single-process run with committed checkpoints at steps 4 and 8, copied by each test."""
    d = tmp_path_factory.mktemp("pristine")
    run_cli(BASE, d)
    assert sorted(os.listdir(ck_folder(d))) == ["step-00000004", "step-00000008"]
    return d


def trained_to_8(tmp_path, source=None, extra=(), nproc=1):
    """A run dir with committed checkpoints at steps 4 and 8 (a copy of `source`, or trained now);
    the test then damages it and resumes to step 12."""
    if source is not None:
        shutil.copytree(source / "run", tmp_path / "run")
    else:
        run_cli(BASE + list(extra), tmp_path, nproc=nproc)
    assert sorted(os.listdir(ck_folder(tmp_path))) == ["step-00000004", "step-00000008"]
    return ck_folder(tmp_path) / "step-00000008"


def distcp(path):
    return sorted(path.glob("*.distcp"))[0]


def flip_bytes(f, at=0.5, n=64):
    with open(f, "r+b") as fh:
        fh.seek(int(os.path.getsize(f) * at))
        fh.write(b"\x7f" * n)


def resume_to_12(tmp_path, extra=(), nproc=1, check=True):
    return run_cli(BASE + ["--training.steps=12"] + list(extra), tmp_path, nproc=nproc, check=check)


@pytest.mark.slow
@pytest.mark.parametrize("damage, words", [
    ("bytes", "fails its CRC32 check"),
    ("truncate", "bytes, "),
    ("metadata", "no .metadata file"),
])
def test_damaged_newest_checkpoint_falls_back_to_previous(damage, words, tmp_path, pristine):
    newest = trained_to_8(tmp_path, pristine)
    if damage == "bytes":
        flip_bytes(distcp(newest))
    elif damage == "truncate":
        with open(distcp(newest), "r+b") as fh:
            fh.truncate(os.path.getsize(distcp(newest)) // 2)
    else:
        os.remove(newest / ".metadata")
    p = resume_to_12(tmp_path)
    line = next(x for x in p.stdout.splitlines() if "is damaged" in x)
    assert str(newest) in line and words in line and "step-00000008.damaged" in line
    assert "resumed   from step 4" in p.stdout
    assert sorted(os.listdir(ck_folder(tmp_path))) == ["step-00000004", "step-00000008", "step-00000008.damaged",
                                                       "step-00000012"]
    assert [r["step"] for r in read_metrics(tmp_path)] == list(range(1, 13))


@pytest.mark.slow
def test_damaged_checkpoint_under_fsdp2_and_stop_mode(tmp_path):
    newest = trained_to_8(tmp_path, None, [P + "data_parallel_shard_degree=2", "--training.local_batch_size=2"], nproc=2)
    flip_bytes(distcp(newest))
    p = resume_to_12(tmp_path, [P + "data_parallel_shard_degree=2", "--training.local_batch_size=2",
                                "--checkpoint.on_damaged=stop"], nproc=2, check=False)
    assert p.returncode == 2
    err = [x for x in p.stderr.splitlines() if x.startswith("torchmeg")]
    assert len(err) == 1 and str(newest) in err[0] and "checkpoint.on_damaged" in err[0], p.stderr[-2000:]
    assert "step " not in p.stdout.split("resumed")[0][-200:]  # trained nothing
    p = resume_to_12(tmp_path, [P + "data_parallel_shard_degree=2", "--training.local_batch_size=2"], nproc=2)
    assert "resumed   from step 4" in p.stdout


def _rewrite_marker_crc(folder):
    meta = json.load(open(folder / "torchmeg.json"))
    for name in meta["files"]:
        data = open(folder / name, "rb").read()
        meta["files"][name] = [len(data), zlib.crc32(data)]
    json.dump(meta, open(folder / "torchmeg.json", "w"))


@pytest.mark.slow
def test_nonfinite_weights_in_an_intact_looking_checkpoint(tmp_path, pristine):
    """NaNs that were in memory before the save (CRCs match): caught by the finite check at load."""
    newest = trained_to_8(tmp_path, pristine)
    f = distcp(newest)
    raw = bytearray(open(f, "rb").read())
    nan = np.array([np.nan] * 256, dtype=np.float32).tobytes()
    raw[len(raw) // 3: len(raw) // 3 + len(nan)] = nan
    open(f, "wb").write(bytes(raw))
    _rewrite_marker_crc(newest)
    p = resume_to_12(tmp_path)
    assert "non-finite values in the loaded weights" in p.stdout and "resumed   from step 4" in p.stdout


@pytest.mark.slow
def test_no_intact_checkpoint_left_is_an_error(tmp_path, pristine):
    newest = trained_to_8(tmp_path, pristine)
    flip_bytes(distcp(newest))
    flip_bytes(distcp(ck_folder(tmp_path) / "step-00000004"))
    p = resume_to_12(tmp_path, check=False)
    assert p.returncode == 2 and "no intact checkpoint left" in p.stderr and "| loss" not in p.stdout


@pytest.mark.slow
def test_incomplete_step_folder_never_blocks_a_save(tmp_path, pristine):
    newest = trained_to_8(tmp_path, pristine)
    os.remove(newest / "torchmeg.json")  # looks like a save that died before its commit
    p = resume_to_12(tmp_path)
    assert "resumed   from step 4" in p.stdout
    assert os.path.isfile(newest / "torchmeg.json")  # step 8 was saved again, over the stale folder
    assert json.load(open(newest / "torchmeg.json"))["step"] == 8


@pytest.mark.slow
def test_resume_applies_changed_optimizer_and_schedule(tmp_path, pristine):
    trained_to_8(tmp_path, pristine)
    shutil.rmtree(ck_folder(tmp_path) / "step-00000008")
    change = ["--optimizer.lr=1e-3", "--lr_scheduler.decay_type=linear"]
    p = resume_to_12(tmp_path, change)
    assert_resumed(p, 4)  # (the step-8 save removed)
    assert "optimizer.lr 0.003 -> 0.001" in p.stdout and "lr_scheduler.decay_type cosine -> linear" in p.stdout
    fresh = tmp_path / "fresh"
    run_cli(BASE + ["--training.steps=12"] + change, fresh)
    want = {r["step"]: r["lr"] for r in read_metrics(fresh)}
    got = {r["step"]: r["lr"] for r in read_metrics(tmp_path)}
    assert all(got[s] == want[s] for s in range(5, 13)), (got, want)


@pytest.mark.slow
def test_resume_with_other_batch_is_refused_or_remapped(tmp_path, pristine):
    trained_to_8(tmp_path, pristine)
    p = resume_to_12(tmp_path, ["--training.global_batch_size=8"], check=False)
    assert p.returncode == 2 and "checkpoint.remap_data_position" in p.stderr and "global batch 4" in p.stderr
    assert len(p.stderr.strip().splitlines()) == 1
    p = resume_to_12(tmp_path, ["--training.global_batch_size=8", "--checkpoint.remap_data_position=true"])
    assert "data position remapped by tokens: 32 samples x 32 -> sample 32 x 32 (global batch 4 -> 8)" in p.stdout
    meta = json.load(open(ck_folder(tmp_path) / "step-00000012" / "torchmeg.json"))
    assert meta["data"] == {"global_batch": 8, "seq_len": 32, "next_sample": 32 + 4 * 8}
    p = resume_to_12(tmp_path, ["--training.global_batch_size=8", "--data.seq_len=64", "--training.steps=13",
                                "--checkpoint.remap_data_position=true"])
    assert "64 samples x 32 -> sample 32 x 64" in p.stdout


# ---- data stores ------------------------------------------------------------------------------

def make_store(prefix, n_docs=50, doc_len=100):
    from torchmeg.data.store import StoreWriter
    rng = np.random.default_rng(0)
    w = StoreWriter(str(prefix), 257)
    for _ in range(n_docs):
        w.add(np.append(rng.integers(0, 256, doc_len), 256))
    w.close()
    return prefix


def _truncate(path, keep):
    with open(path, "r+b") as fh:
        fh.truncate(keep)


@pytest.mark.slow
@pytest.mark.parametrize("damage, file, words", [
    ("truncate_bin", ".bin", "truncated"),
    ("extra_bin", ".bin", "extra bytes"),
    ("truncate_idx", ".idx", "truncated"),
    ("magic", ".idx", "is neither Megatron's"),
    ("dtype", ".idx", "dtype code"),
    ("offsets", ".idx", "monotonically"),
    ("ids", ".bin", "outside the vocabulary"),
])
def test_damaged_store_is_named_in_one_line(damage, file, words, tmp_path):
    prefix = make_store(tmp_path / "corpus")
    b, i = f"{prefix}.bin", f"{prefix}.idx"
    if damage == "truncate_bin":
        _truncate(b, os.path.getsize(b) - 10)
    elif damage == "extra_bin":
        open(b, "ab").write(b"\0" * 8)
    elif damage == "truncate_idx":
        _truncate(i, os.path.getsize(i) - 16)
    elif damage in ("magic", "dtype"):
        with open(i, "r+b") as fh:
            fh.seek(0 if damage == "magic" else 8)
            fh.write(b"XX" if damage == "magic" else b"\x09")
    elif damage == "offsets":
        with open(i, "r+b") as fh:
            fh.seek(32 + 8 * 10)
            fh.write(np.int64(10 ** 6).tobytes())
    else:
        with open(b, "r+b") as fh:
            fh.seek(20)
            fh.write(np.uint16(9999).tobytes())
    p = run_cli(TINY + ["--training.steps=2", f"--data.dataset={prefix}"], tmp_path, check=False)
    assert p.returncode == 2 and len(p.stderr.strip().splitlines()) == 1, p.stderr[-2000:]
    assert f"{prefix}{file}" in p.stderr and words in p.stderr, p.stderr


# ---- preprocessing ----------------------------------------------------------------------------

@pytest.mark.slow
@pytest.mark.parametrize("content, words", [
    (b'{"text": "fine"}\n{"text": null}\n', "in.jsonl:2: 'text' is null"),
    (b'{"text": "fine"}\n[1, 2]\n', "in.jsonl:2: expected a JSON object"),
    (b'{"text": "fine"}\n\n{"text": "\xff\xfe"}\n', "in.jsonl:3: not UTF-8"),
    (b'{"text": "fine"}\n{"text": 5}\n', "in.jsonl:2: 'text' is a int"),
    (b'{"text": "fine"}\n{"txt": "x"}\n', "in.jsonl:2: no key 'text'"),
    (b'', "no documents"),
])
def test_preprocess_rejects_bad_records_and_leaves_nothing(content, words, tmp_path):
    _preprocess_fails(content, words, tmp_path, train_tokenizer=False)


@pytest.mark.slow
def test_preprocess_with_tokenizer_training_leaves_nothing(tmp_path):
    _preprocess_fails(b'{"text": "fine"}\n{"text": null}\n', "in.jsonl:2: 'text' is null", tmp_path, train_tokenizer=True)


def _preprocess_fails(content, words, tmp_path, train_tokenizer):
    src = tmp_path / "in.jsonl"
    src.write_bytes(content)
    cmd = [sys.executable, "tools/preprocess_data.py", "--input", str(src), "--output-prefix", str(tmp_path / "out" / "c")]
    if train_tokenizer:
        cmd += ["--train-tokenizer", "--vocab-size", "300"]
    p = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert p.returncode == 1 and words in p.stderr, p.stderr[-2000:]
    assert not (tmp_path / "out").exists() or os.listdir(tmp_path / "out") == []


@pytest.mark.slow
def test_preprocess_can_skip_bad_records(tmp_path):
    src = tmp_path / "in.jsonl"
    src.write_bytes(b'{"text": "one"}\n{"text": null}\nnot json\n{"text": "two"}\n')
    p = subprocess.run([sys.executable, "tools/preprocess_data.py", "--input", str(src), "--output-prefix",
                        str(tmp_path / "c"), "--on-bad-record", "skip"], cwd=ROOT, capture_output=True, text=True,
                       timeout=120)
    assert p.returncode == 0 and "skipped 2 bad record(s)" in p.stderr and "in.jsonl:3: not JSON" in p.stderr
    from torchmeg.data.store import open_store
    s = open_store(str(tmp_path / "c"))
    assert s.n_docs == 2 and s.n_tokens == len("one") + len("two") + 2
