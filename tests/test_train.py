"""End-to-end runs of the real CLI on one process."""
import json
import os
import subprocess
import sys

import pytest

from conftest import FP32_PARITY, TINY, assert_parity, read_metrics
from launch import ROOT, run_cli


@pytest.mark.slow
def test_cli_trains_and_logs(tmp_path):
    p = run_cli(TINY + ["--training.steps=30", "--metrics.enable_tensorboard=true", "--validation.enable=true",
                        "--validation.freq=15", "--validation.steps=2", "--metrics.log_freq=5"], tmp_path)
    rows = read_metrics(tmp_path)
    assert [r["step"] for r in rows] == [1, 5, 10, 15, 20, 25, 30]
    for r in rows:
        for k in ("step", "loss", "grad_norm", "lr", "tokens_per_sec", "tflops", "mfu", "memory_gib", "elapsed_ms"):
            assert k in r, k
        assert r["memory_gib"] > 0.05 and 0 < r["mfu"] < 1 and r["tokens_per_sec"] > 0
        assert "memory_allocated_gib" not in r  # (a GPU's allocator only: tests/gpu)
    assert rows[-1]["loss"] < rows[0]["loss"] - 1.0
    assert "val_loss" in rows[3] and "val_loss" in rows[-1]
    assert "peak" in p.stdout and "TFLOP/s" in p.stdout and "step    30 | loss" in p.stdout
    if sys.platform.startswith("linux"):  # job.cpu_keep_freed_memory's default took effect
        assert "| glibc keeps freed memory" in p.stdout.split("layout     ", 1)[1].split("\n")[0], p.stdout[:2000]

    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    ea = EventAccumulator(os.path.join(tmp_path, "run", "tb"))
    ea.Reload()
    for tag in ("loss", "grad_norm", "lr", "tokens_per_sec", "tflops", "mfu", "memory_gib", "val_loss"):
        assert tag in ea.Tags()["scalars"], tag
    losses = ea.Scalars("loss")
    assert [e.step for e in losses] == [r["step"] for r in rows]
    assert [e.value for e in losses] == pytest.approx([r["loss"] for r in rows], rel=1e-6)


@pytest.mark.slow
def test_grad_accumulation_equals_one_big_batch(tmp_path):
    common = TINY + ["--training.steps=4", "--training.deterministic=true", "--training.global_batch_size=8"]
    run_cli(common + ["--training.local_batch_size=8"], tmp_path, name="big")
    run_cli(common + ["--training.local_batch_size=2"], tmp_path, name="accum")
    big, acc = read_metrics(tmp_path, "big"), read_metrics(tmp_path, "accum")
    assert len(big) == len(acc) == 4
    assert_parity(big, acc, rtol=FP32_PARITY)  # summed in another order: the fp32 parity rule


@pytest.mark.slow
def test_trains_on_preprocessed_store_with_trained_bpe(tmp_path):
    src = tmp_path / "corpus.jsonl"
    lib = os.path.dirname(json.__file__)
    texts = [open(os.path.join(lib, f)).read() for f in sorted(os.listdir(lib)) if f.endswith(".py")]
    import textwrap
    import inspect
    texts += [textwrap.dedent(inspect.getsource(inspect))]
    src.write_text("\n".join(json.dumps({"text": t}) for t in texts) + "\n")
    p = subprocess.run([sys.executable, "tools/preprocess_data.py", "--input", str(src), "--output-prefix",
                        str(tmp_path / "corpus"), "--train-tokenizer", "--vocab-size", "512"],
                       cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr
    run_cli(TINY + ["--training.steps=12", f"--data.dataset={tmp_path / 'corpus'}",
                    f"--data.tokenizer={tmp_path / 'corpus.tokenizer.json'}"], tmp_path)
    rows = read_metrics(tmp_path)
    assert rows[-1]["loss"] < rows[0]["loss"]
    # The same store with the wrong tokenizer is refused before training.
    p = run_cli(TINY + [f"--data.dataset={tmp_path / 'corpus'}"], tmp_path, check=False)
    assert p.returncode == 2 and "data.dataset" in p.stderr and "tokenizer" in p.stderr


@pytest.mark.slow
def test_nonfinite_step_is_skipped_or_stops(tmp_path):
    args = TINY + ["--training.steps=4", "--optimizer.lr=1e30", "--lr_scheduler.warmup_steps=0",
                   "--training.max_norm=0"]
    run_cli(args + ["--training.on_nonfinite=skip"], tmp_path, name="skip")
    rows = read_metrics(tmp_path, "skip")
    assert any(r.get("skipped") for r in rows)
    p = run_cli(args + ["--training.on_nonfinite=stop"], tmp_path, name="stop", check=False)
    assert p.returncode != 0 and "non-finite" in p.stderr


FAULTS = r"""
import ctypes, resource
libc = ctypes.CDLL("libc.so.6")
libc.malloc.restype, libc.malloc.argtypes = ctypes.c_void_p, [ctypes.c_size_t]
libc.free.argtypes = [ctypes.c_void_p]

def faults():  # minor page faults over 10 rounds of a step's large activations (4 x 12 MiB, freed together)
    def one():
        blocks = [libc.malloc(12 << 20) for _ in range(4)]
        for b in blocks:
            ctypes.memset(b, 1, 12 << 20)
        for b in blocks:
            libc.free(b)
    one(); one()
    f0 = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    for _ in range(10):
        one()
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt - f0

before = faults()  # glibc's defaults: torch is not imported yet, nothing has moved its thresholds
from torchmeg.runtime.process import keep_freed_memory
print(before, keep_freed_memory(), faults())
"""


@pytest.mark.slow
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's mallopt")
def test_cpu_runs_keep_freed_memory_instead_of_faulting_it_back():
    """job.cpu_keep_freed_memory (on by default on CPU): with glibc's defaults the 48 MiB freed at the
    top of the heap are trimmed back to the kernel and every round faults all their pages in again
    (3,072 per 12 MiB block); kept, the rounds after the first reuse them."""
    p = subprocess.run([sys.executable, "-c", FAULTS], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert p.returncode == 0, p.stderr[-2000:]
    before, applied, after = p.stdout.split()
    pages = 10 * 4 * (12 << 20) // 4096
    assert applied == "True" and int(before) >= 0.9 * pages and int(after) <= 0.01 * pages, p.stdout
