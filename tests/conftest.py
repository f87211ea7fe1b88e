"""The suite's settings and shared runs: the OpenMP settings every process inherits, the tiny model,
the runs several tests read (trained once per test run), metrics and resume checks, the markers.
Launching (the CLI on one process or N ranks, the zygote) is tests/launch.py."""
from __future__ import annotations

import inspect
import re
import json
import os
import shutil
import subprocess
import sys

# GNU OpenMP (torch's CPU wheel links libgomp) spins a waiting thread 300,000 times before it sleeps:
# on a machine whose cores are busy with other work (another test worker, a build) a two-thread run
# whose partner thread is descheduled burns its time slices spinning. Measured on the 2-core machine,
# the MoE debug recipe's test: quiet 11.1 s as is, 11.5 s at 1,000 spins; beside two busy processes
# 87 s as is, 26 s at 1,000 (OMP_WAIT_POLICY=passive: 23 s, but 15.3 s quiet). Read once, when libgomp
# loads: set before torch is imported here and inherited by every process the suite starts.
os.environ.setdefault("GOMP_SPINCOUNT", "1000")


def cores_per_worker() -> int | None:
    """Under pytest-xdist, each worker's share of the cores (None in a serial run)."""
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "0") or 0)
    if workers < 2:
        return None
    from torchmeg.runtime.cpus import usable_cores  # (lazy: at the call, after the settings above; torch-free)
    return max(1, usable_cores() // workers)


# Each worker runs torch (here and in every process it starts that does not set its own count) on its
# share of the cores, not on all of them: with two workers on two cores, two one-process runs at torch's
# default of two threads each put four threads on two cores, and even at 1,000 spins a thread waiting
# at a parallel region for a descheduled partner loses time. Measured on the 2-core machine, two
# 30-step debug_llama runs side by side (as two workers run them), GOMP_SPINCOUNT=1000 for both:
# 31.9 / 31.4 s at two threads each, 26.9 / 28.0 s at one (interleaved pairs). Set before torch is
# imported, so this process reads it too; a count the user set is kept.
_SHARE = cores_per_worker()
if _SHARE is not None:
    os.environ.setdefault("OMP_NUM_THREADS", str(_SHARE))

import pytest  # noqa: E402

import processes  # noqa: E402
import timeline  # noqa: E402
from launch import ROOT, run_cli  # noqa: E402
# (the comparison rule lives in tests/tolerance.py; its names are also the test modules' `from conftest import`)
pytest.register_assert_rewrite("tolerance")  # (its asserts report their values, as they did in conftest)
from tolerance import (BF16_U, FP32_PARITY, assert_close, assert_parity, assert_tensor_close,  # noqa: E402,F401
                       rel_diff, uses_rule)

# A model small enough that a 4-rank run fits in seconds on 2 cores, big enough that every
# parallel dimension divides it (heads 4, kv heads 2, FFN 192, vocab 320, seq 32).
TINY = ["--model.dim=64", "--model.n_layers=2", "--model.n_heads=4", "--model.n_kv_heads=2",
        "--model.multiple_of=64", "--data.seq_len=32", "--training.local_batch_size=4",
        "--lr_scheduler.warmup_steps=2", "--metrics.log_freq=1", "--validation.enable=true",
        "--validation.steps=2", "--metrics.enable_tensorboard=false"]
# Validation is on as in the shipped recipes: it runs after the last step of every parity run, and
# its val_loss is compared too.


def byte_level_bpe(path, vocab_size: int, special: list[str]) -> None:
    """A byte-level BPE trained on two stdlib modules' source, with `special` tokens, saved as
    `path` (a tokenizer.json, as transformers saves a fast tokenizer's): built here, never downloaded."""
    import textwrap
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=special,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator([inspect.getsource(textwrap), inspect.getsource(json)], trainer)
    tok.save(str(path))


def decoded_runs(decode, ids, mask) -> list[str]:
    """Each run of consecutive target tokens (mask 1), decoded: what a chat sample trains on."""
    out, i = [], 0
    while i < len(mask):
        if mask[i]:
            j = i
            while j < len(mask) and mask[j]:
                j += 1
            out.append(decode(ids[i:j].tolist()))
            i = j
        else:
            i += 1
    return out


def assert_resumed(p: subprocess.CompletedProcess, step: int) -> None:
    """The run `p` resumed from its checkpoint of `step`: the trainer says so, and every step it trained
    comes after it (a run that silently restarts from 0, deterministic as it is, would repeat the
    uninterrupted run's last steps exactly: comparing those alone cannot see it)."""
    m = re.search(r"^resumed +from step (\d+)", p.stdout, re.M)
    assert m is not None, f"the run did not resume (no 'resumed from' line):\n{p.stdout[:3000]}"
    assert int(m.group(1)) == step, f"resumed from step {m.group(1)}, not {step}"
    trained = [int(s) for s in re.findall(r"^step +(\d+) \|", p.stdout, re.M)]
    assert trained and min(trained) > step, f"after resuming from step {step} the run logged steps {trained}"


def read_metrics(tmp_path, name: str = "run") -> list[dict]:
    with open(os.path.join(tmp_path, name, "metrics.jsonl")) as fh:
        return [json.loads(line) for line in fh]


@pytest.fixture(scope="session")
def tiny_args():
    return list(TINY)


def reference_run(tmp_path_factory, args: list[str]) -> list[dict]:
    """The single-process run a layout is compared against: its logged metrics."""
    d = tmp_path_factory.mktemp("ref")
    run_cli(list(args), d)
    return read_metrics(d)


def trained_once(tmp_path_factory, folder: str, args: list[str], name: str, timeout: int):
    """A run several tests only read, trained once per test run: under pytest-xdist in the folder the
    workers share (this run's temp root), the first worker to ask trains it while a file lock holds the
    others back. -> the run's dump folder."""
    from filelock import FileLock  # lazy: torch's own dependency, needed only by these fixtures
    d = shared_folder(tmp_path_factory, folder)
    with FileLock(str(d) + ".lock"):
        if not (d / "trained").exists():
            shutil.rmtree(d, ignore_errors=True)
            run_cli(args, d, name=name, timeout=timeout)
            (d / "trained").touch()
    return d


def shared_folder(tmp_path_factory, name: str):
    """A folder every worker of this test run shares (this run's temp root under pytest-xdist)."""
    base = tmp_path_factory.getbasetemp()
    return (base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base) / name  # (xdist or not)


def user_module(tmp_path, filename: str, text: str) -> str:
    """A user's module (a reward function file) written into one folder per worker for the test run
    (pytest's base folder, tmp_path's parent), not the test's own: the folder goes on the runs'
    PYTHONPATH, which is part of a fork server's identity (tests/zygote.py: Python reads it at start),
    so one folder per test started one server, ~4 s of imports, per test. -> the folder."""
    folder = tmp_path.parent / "user_modules"
    folder.mkdir(exist_ok=True)
    (folder / filename).write_text(text)
    return str(folder)


@pytest.fixture(scope="session")
def plan_traces(tmp_path_factory):
    """A plan.trace_cache for this test run: the published rows that trace one program (eager and
    compiled rows, async TP on and off, another GPU) trace it once. tests/test_plan_trace_cache.py
    shows a plan read from it equals a fresh one to the last bit."""
    return str(shared_folder(tmp_path_factory, "plan_traces"))


@pytest.fixture(scope="session")
def debug_run(tmp_path_factory):
    """The default recipe (validation, checkpoints on), 30 steps, exported to HF at the end: the
    trained model generation, evaluation and serving are tested on (job name "debug"), trained once
    per test run (~35 s of a worker saved when test_generate and test_serve land on different
    workers); the tests only read it."""
    return trained_once(tmp_path_factory, "debug_run", [
        "--config", "recipes/debug_llama.toml", "--training.steps=30", "--checkpoint.interval=30",
        "--checkpoint.export_hf=true", "--metrics.enable_tensorboard=false"], "debug", 240)


# The default recipe's model for 30 steps on 128-token sequences, its held-out loss at step 30 over 8
# batches (so one batch's noise does not decide): what a low-precision recipe's run of the same
# settings is compared with (float8, MXFP8). 128 tokens, not the recipe's 256: the emulated casts are
# Python-level ops, ~3x an fp32 step here.
LOW_PRECISION_VS_FP32 = ["--config", "recipes/debug_llama.toml", "--training.steps=30", "--validation.freq=30",
                         "--validation.steps=8", "--metrics.enable_tensorboard=false", "--metrics.log_freq=10",
                         "--data.seq_len=128"]


@pytest.fixture(scope="session")
def fp32_debug_run(tmp_path_factory):
    """LOW_PRECISION_VS_FP32 in fp32 (job name "fp32"), trained once per test run (the float8 and
    MXFP8 tests share it)."""
    return trained_once(tmp_path_factory, "fp32_debug_run", LOW_PRECISION_VS_FP32, "fp32", 300)


@pytest.fixture(scope="session")
def short_docs(tmp_path_factory):
    """A store of short documents (stdlib functions), so 32-token windows cross boundaries."""
    d = tmp_path_factory.mktemp("short")
    texts = [inspect.getsource(f) for f in vars(json.decoder).values() if inspect.isfunction(f)]
    texts += [inspect.getsource(f) for f in vars(inspect).values() if inspect.isfunction(f)][:200]
    src = d / "in.jsonl"
    src.write_text("\n".join(json.dumps({"text": t}) for t in texts) + "\n")
    p = subprocess.run([sys.executable, "tools/preprocess_data.py", "--input", str(src), "--output-prefix",
                        str(d / "fns")], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr
    return d / "fns"


def pytest_configure(config):
    processes.install()
    config.pluginmanager.register(processes, "torchmeg-processes")
    timeline.register(config)  # (TORCHMEG_TEST_TIMELINE=FILE: where the run's time went)


def pytest_collection_modifyitems(config, items):
    for item in items:
        fn = getattr(item, "function", None)
        if fn is not None and uses_rule(fn, item.module):
            item.add_marker(pytest.mark.parity)
        if fn is not None and ("compile" in item.originalname or "--compile.enable=true" in inspect.getsource(fn)):
            item.add_marker(pytest.mark.compile)
