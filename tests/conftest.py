"""Shared helpers: run the real CLI (one process or torchrun with N ranks) and read its metrics."""
from __future__ import annotations

import atexit
import collections
import inspect
import random
import re
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time

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
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return max(1, cores // workers)


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
# (the comparison rule lives in tests/tolerance.py; its names are also the test modules' `from conftest import`)
pytest.register_assert_rewrite("tolerance")  # (its asserts report their values, as they did in conftest)
from tolerance import (BF16_U, FP32_PARITY, assert_close, assert_parity, assert_tensor_close,  # noqa: E402,F401
                       rel_diff, uses_rule)

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# A model small enough that a 4-rank run fits in seconds on 2 cores, big enough that every
# parallel dimension divides it (heads 4, kv heads 2, FFN 192, vocab 320, seq 32).
TINY = ["--model.dim=64", "--model.n_layers=2", "--model.n_heads=4", "--model.n_kv_heads=2",
        "--model.multiple_of=64", "--data.seq_len=32", "--training.local_batch_size=4",
        "--lr_scheduler.warmup_steps=2", "--metrics.log_freq=1", "--validation.enable=true",
        "--validation.steps=2", "--metrics.enable_tensorboard=false"]
# Validation is on as in the shipped recipes: it runs after the last step of every parity run, and
# its val_loss is compared too.


PORTS = (20000, 12000)  # the first port the suite draws from, how many
_PORT_DRAW = random.Random()  # (its own: a test that seeds `random` does not replay the suite's ports)


def _free_port() -> int:
    """A port free now, from a range below the kernel's ephemeral ports (32768+: the local ends of
    every connection the runs open, which could take a port between its release here and the bind
    of the run it is for). Under pytest-xdist each worker draws from a slice of its own, so two
    workers never hand out the same port."""
    worker = int(os.environ.get("PYTEST_XDIST_WORKER", "gw0")[2:] or 0)
    count = max(int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1")), 1)
    size = PORTS[1] // count
    for _ in range(200):
        port = PORTS[0] + worker * size + _PORT_DRAW.randrange(size)
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue  # in use
            return port
    raise RuntimeError(f"no free port in {PORTS[0] + worker * size}..{PORTS[0] + (worker + 1) * size}")


class _Forked:
    """A run forked by the zygote (`tests/zygote.py`), with the part of Popen's interface the suite
    uses: pid, poll(), wait(timeout), kill(), returncode."""

    def __init__(self, conn: socket.socket):
        self._conn, self._buf, self.returncode = conn, b"", None
        self.pid = json.loads(self._line(timeout=60))["pid"]

    def _line(self, timeout):
        self._conn.settimeout(timeout)
        while b"\n" not in self._buf:
            data = self._conn.recv(4096)
            if not data:
                raise RuntimeError("the zygote went away")
            self._buf += data
        line, self._buf = self._buf.split(b"\n", 1)
        return line

    def poll(self):
        if self.returncode is None:
            try:
                self.returncode = json.loads(self._line(timeout=0.001))["rc"]
                self._conn.close()
            except (socket.timeout, BlockingIOError):
                pass
        return self.returncode

    def wait(self, timeout=None):
        if self.returncode is None:
            try:
                self.returncode = json.loads(self._line(timeout=timeout))["rc"]
            except socket.timeout:
                raise subprocess.TimeoutExpired(self.pid, timeout) from None
            self._conn.close()
        return self.returncode

    def kill(self):
        if self.returncode is None:
            for kill in (os.killpg, os.kill):  # the run and what it started (it leads its group once it runs)
                try:
                    kill(self.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass


class _Zygote:
    """A fork server (tests/zygote.py) for runs whose environment has `key` (its import-time part)."""

    def __init__(self, env: dict):
        self.dir = tempfile.mkdtemp(prefix="torchmeg-zygote-")
        self.path = os.path.join(self.dir, "sock")
        with open(os.path.join(self.dir, "log"), "w") as log, processes.keep():  # lives for the session
            self.proc = subprocess.Popen([sys.executable, os.path.join(ROOT, "tests", "zygote.py"), self.path],
                                         cwd=ROOT, env=env, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                         stderr=log, text=True)
        ready = self.proc.stdout.readline()  # the server prints it after its imports, or dies
        if ready.strip() != "ready":
            raise RuntimeError(f"the test zygote did not start: {open(os.path.join(self.dir, 'log')).read()[-2000:]}")
        atexit.register(self.close)

    def spawn(self, module: str, args: list[str], env: dict, out_path: str, err_path: str) -> _Forked:
        processes.launching(f"python -m {module}, forked by the test zygote")
        conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        conn.connect(self.path)
        conn.sendall(json.dumps({"module": module, "args": list(args), "env": env, "cwd": ROOT,
                                 "stdout": out_path, "stderr": err_path}).encode() + b"\n")
        run = _Forked(conn)
        processes.started(run.pid)
        return run

    def close(self):
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
        shutil.rmtree(self.dir, ignore_errors=True)


_ZYGOTES: "collections.OrderedDict[tuple, _Zygote]" = collections.OrderedDict()
# One-process runs and ranks (OMP_NUM_THREADS=1) need two servers; tests with an environment of their
# own (compile tests' inductor cache folder) get one each, the least recently used going first.
_MAX_ZYGOTES = 4
_ZYGOTE_LOCK = threading.Lock()


def _zygote_for(env: dict):
    """The fork server for a run with `env`, started at first use; None with TORCHMEG_TEST_NO_ZYGOTE=1
    (every run in a fresh interpreter). Thread-safe: tests start runs from a pool."""
    if os.environ.get("TORCHMEG_TEST_NO_ZYGOTE") == "1":
        return None
    with _ZYGOTE_LOCK:
        return _zygote_locked(env)


def _zygote_locked(env: dict):
    from zygote import import_key
    key = import_key(env)
    if key in _ZYGOTES:
        _ZYGOTES.move_to_end(key)
        return _ZYGOTES[key]
    while len(_ZYGOTES) >= _MAX_ZYGOTES:
        _ZYGOTES.popitem(last=False)[1].close()
    _ZYGOTES[key] = _Zygote(env)
    return _ZYGOTES[key]


def _start(cmd: list[str], env: dict, out_path: str, err_path: str):
    """`python -m MODULE ARGS` (cmd) as a fork of the zygote when its environment allows, else a
    fresh interpreter; stdout/stderr to the two files."""
    z = _zygote_for(env) if cmd[1] == "-m" and env.get("TORCHMEG_TEST_NO_ZYGOTE") != "1" else None
    if z is not None:
        return z.spawn(cmd[2], cmd[3:], env, out_path, err_path)
    with open(out_path, "w") as out, open(err_path, "w") as err:
        return subprocess.Popen(cmd, cwd=ROOT, env=env, stdin=subprocess.DEVNULL, stdout=out, stderr=err)


def _launch_ranks(cmd: list[str], nproc: int, env: dict, timeout: int) -> subprocess.CompletedProcess:
    """Start nproc real processes with the environment torchrun gives its workers (RANK, WORLD_SIZE,
    MASTER_ADDR/PORT, one OpenMP thread each), ~1 s cheaper per run than torchrun's agent. The
    first rank to fail ends the others, and the whole run is bounded by `timeout`."""
    port, procs, outs = _free_port(), [], []
    logs = tempfile.mkdtemp(prefix="torchmeg-ranks-")
    try:
        for r in range(nproc):
            e = dict(env, RANK=str(r), LOCAL_RANK=str(r), WORLD_SIZE=str(nproc), LOCAL_WORLD_SIZE=str(nproc),
                     GROUP_RANK="0", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), OMP_NUM_THREADS="1")
            out_path, err_path = os.path.join(logs, f"{r}.out"), os.path.join(logs, f"{r}.err")
            procs.append(_start(cmd, e, out_path, err_path))
            outs.append((out_path, err_path))
        deadline, rc = time.time() + processes.bound(timeout), 0
        while any(p.poll() is None for p in procs):
            failed = [p.returncode for p in procs if p.returncode not in (None, 0)]
            if failed or time.time() > deadline:
                rc = failed[0] if failed else 124
                time.sleep(1.0)  # let the others report, then stop them
                for p in procs:
                    if p.poll() is None:
                        p.kill()
                break
            time.sleep(0.05)
        for p in procs:
            p.wait()
        rc = rc or next((p.returncode for p in procs if p.returncode), 0)
        text = [(open(o).read(), open(e).read()) for o, e in outs]
    finally:
        shutil.rmtree(logs, ignore_errors=True)
    done = subprocess.CompletedProcess(cmd, rc, text[0][0], "\n".join(e for _, e in text))
    # each failed rank's own last lines (the tail of the joined stderr is the last rank's: a peer's
    # "connection reset" hid the rank that died first)
    done.rank_tails = "".join(f"\n--- rank {r} (exit {p.returncode}) stdout/stderr tail ---\n{o[-1500:]}\n{e[-4000:]}"
                              for r, (p, (o, e)) in enumerate(zip(procs, text)) if p.returncode)
    return done


def plan_and_measure(common: list[str], world: int, tmp_path, ranks=None) -> tuple[dict, list[dict]]:
    """`python -m torchmeg.plan --world W COMMON` planned while the same recipe runs for real on W gloo
    ranks (`plan --measure`, step 2 under the planner's trackers) -> (the plan's JSON, the measured
    JSON of each rank in `ranks`, by default of each rank the plan lists)."""
    planner = subprocess.Popen([sys.executable, "-m", "torchmeg.plan", "--world", str(world), "--json",
                                str(tmp_path / "plan.json")] + common, cwd=ROOT, stdout=subprocess.PIPE,
                               stderr=subprocess.PIPE, text=True, env=dict(os.environ, OMP_NUM_THREADS="1"))
    run = _launch_ranks([sys.executable, "-m", "torchmeg.plan", "--measure", "--json", str(tmp_path / "m")] + common,
                        world, dict(os.environ, PYTHONUNBUFFERED="1"), timeout=180)
    _, err = planner.communicate(timeout=processes.bound(180))
    assert run.returncode == 0, run.stderr[-3000:]
    assert planner.returncode == 0, err[-3000:]
    plan = json.load(open(tmp_path / "plan.json"))
    ranks = [r["rank"] for r in plan["ranks"]] if ranks is None else ranks
    return plan, [json.load(open(tmp_path / f"m.rank{r}")) for r in ranks]


def _run_one(cmd: list[str], env: dict, timeout: int) -> subprocess.CompletedProcess:
    """One process, as subprocess.run(capture_output=True, timeout=...) would."""
    logs, timeout = tempfile.mkdtemp(prefix="torchmeg-run-"), processes.bound(timeout)
    try:
        out_path, err_path = os.path.join(logs, "out"), os.path.join(logs, "err")
        p = _start(cmd, env, out_path, err_path)
        try:
            rc = p.wait(timeout)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()
            raise
        return subprocess.CompletedProcess(cmd, rc, open(out_path).read(), open(err_path).read())
    finally:
        shutil.rmtree(logs, ignore_errors=True)


def run_cli(args: list[str], tmp_path, nproc: int = 1, name: str = "run", timeout: int = 120,
            env: dict | None = None, check: bool = True, torchrun: bool = False,
            fresh: bool = False) -> subprocess.CompletedProcess:
    """`python -m torchmeg.train` on one process, or on nproc ranks (torchrun --standalone when
    `torchrun`, else the same worker environment set up directly). Forked from the suite's zygote
    (tests/zygote.py) when the run's environment allows: the same run without the ~2.4 s of imports.
    `fresh`: a new interpreter whatever the environment (a test of what happens at import).
    `timeout`: a floor, raised to what is left of the test's own timeout (processes.bound)."""
    full_env = dict(os.environ)
    full_env.update({"PYTHONUNBUFFERED": "1"})
    full_env.update(env or {})
    if fresh:
        full_env["TORCHMEG_TEST_NO_ZYGOTE"] = "1"
    train = ["-m", "torchmeg.train", f"--job.dump_folder={tmp_path}", f"--job.name={name}"] + list(args)
    if nproc > 1 and not torchrun:
        p = _launch_ranks([sys.executable] + train, nproc, full_env, timeout)
    elif nproc == 1:
        p = _run_one([sys.executable] + train, full_env, timeout)
    else:
        p = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone",
                            f"--nproc_per_node={nproc}"] + train, cwd=ROOT, env=full_env, capture_output=True,
                           text=True, timeout=timeout)
    if check and p.returncode != 0:
        raise AssertionError(f"exit {p.returncode}: {' '.join(p.args)}\n{p.stdout[-3000:]}\n{p.stderr[-6000:]}"
                             + getattr(p, "rank_tails", ""))
    return p


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


def own_tmp(folder) -> dict:
    """The environment of a process whose temporary files go to `folder` (TMPDIR), so a test can see
    what it left there; inductor's kernel cache stays where it was (its default follows TMPDIR)."""
    from torch._inductor.runtime.cache_dir_utils import default_cache_dir  # (lazy: inductor's import)
    return dict(os.environ, TMPDIR=str(folder),
                TORCHINDUCTOR_CACHE_DIR=os.environ.get("TORCHINDUCTOR_CACHE_DIR") or default_cache_dir())


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
