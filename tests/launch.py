"""Launching what the tests run: the real CLI on one process or on N gloo ranks, forked from the
suite's zygote (tests/zygote.py) where the run's environment allows, else a fresh interpreter; every
launch bounded by the test's own timeout (processes.bound) and killed whole when the test ends
(processes). The shared runs and fixtures built on these are in conftest.py."""
from __future__ import annotations

import atexit
import collections
import json
import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time

import processes
import timeline
from torchmeg.runtime.ports import free_port_in

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

PORTS = (20000, 12000)  # the first port the suite draws from, how many
_PORT_DRAW = random.Random()  # (its own: a test that seeds `random` does not replay the suite's ports)


def free_port() -> int:
    """A port free now, from a range below the kernel's ephemeral ports (32768+: the local ends of
    every connection the runs open, which could take a port between its release here and the bind
    of the run it is for). Under pytest-xdist each worker draws from a slice of its own, so two
    workers never hand out the same port."""
    worker = int(os.environ.get("PYTEST_XDIST_WORKER", "gw0")[2:] or 0)
    count = max(int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1")), 1)
    size = PORTS[1] // count
    port = free_port_in(PORTS[0] + worker * size, PORTS[0] + (worker + 1) * size, _PORT_DRAW, "127.0.0.1")
    if port is not None:
        return port
    raise RuntimeError(f"no free port in {PORTS[0] + worker * size}..{PORTS[0] + (worker + 1) * size}")


class Forked:
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


class Zygote:
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

    def spawn(self, module: str, args: list[str], env: dict, out_path: str, err_path: str,
              script: str = "") -> Forked:
        """`python -m MODULE ARGS`, or with `script` `python SCRIPT ARGS`, forked."""
        processes.launching(f"python {script or '-m ' + module}, forked by the test zygote")
        conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        conn.connect(self.path)
        conn.sendall(json.dumps({"module": module, "script": script, "args": list(args), "env": env, "cwd": ROOT,
                                 "stdout": out_path, "stderr": err_path}).encode() + b"\n")
        run = Forked(conn)
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


_ZYGOTES: "collections.OrderedDict[tuple, Zygote]" = collections.OrderedDict()
# One-process runs and ranks (OMP_NUM_THREADS=1) need two servers; tests with an environment of their
# own (compile tests' inductor cache folder) get one each, the least recently used going first.
_MAX_ZYGOTES = 4
_ZYGOTE_LOCK = threading.Lock()


def zygote_for(env: dict):
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
    _ZYGOTES[key] = Zygote(env)
    return _ZYGOTES[key]


def start(cmd: list[str], env: dict, out_path: str, err_path: str):
    """`python -m MODULE ARGS` or one of the suite's own scripts (`python tests/X.py ARGS`: the workers
    the multi-rank tests run) as a fork of the zygote when its environment allows, else a fresh
    interpreter; stdout/stderr to the two files."""
    path = os.path.abspath(os.path.join(ROOT, cmd[1]))  # (a path relative to the checkout, or absolute)
    script = path if path.endswith(".py") and os.path.dirname(path) == os.path.join(ROOT, "tests") else ""
    forkable = cmd[0] == sys.executable and (cmd[1] == "-m" or script)
    z = zygote_for(env) if forkable and env.get("TORCHMEG_TEST_NO_ZYGOTE") != "1" else None
    if z is not None:
        if script:
            return z.spawn("", cmd[2:], env, out_path, err_path, script=script)
        return z.spawn(cmd[2], cmd[3:], env, out_path, err_path)
    with open(out_path, "w") as out, open(err_path, "w") as err:
        return subprocess.Popen(cmd, cwd=ROOT, env=env, stdin=subprocess.DEVNULL, stdout=out, stderr=err)


def launch_ranks(cmd: list[str], nproc: int, env: dict, timeout: int) -> subprocess.CompletedProcess:
    """Start nproc real processes with the environment torchrun gives its workers (RANK, WORLD_SIZE,
    MASTER_ADDR/PORT, one OpenMP thread each), ~1 s cheaper per run than torchrun's agent. The
    first rank to fail ends the others, and the whole run is bounded by `timeout`."""
    port, procs, outs = free_port(), [], []
    logs = tempfile.mkdtemp(prefix="torchmeg-ranks-")
    try:
        for r in range(nproc):
            e = dict(env, RANK=str(r), LOCAL_RANK=str(r), WORLD_SIZE=str(nproc), LOCAL_WORLD_SIZE=str(nproc),
                     GROUP_RANK="0", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), OMP_NUM_THREADS="1")
            out_path, err_path = os.path.join(logs, f"{r}.out"), os.path.join(logs, f"{r}.err")
            procs.append(start(cmd, e, out_path, err_path))
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


def plan_and_measure(common: list[str], world: int, tmp_path, ranks=None, stderr: dict | None = None
                     ) -> tuple[dict, list[dict]]:
    """`python -m torchmeg.plan --world W COMMON` planned while the same recipe runs for real on W gloo
    ranks (`plan --measure`, step 2 under the planner's trackers) -> (the plan's JSON, the measured
    JSON of each rank in `ranks`, by default of each rank the plan lists). `stderr`, when given, gets
    the planner's ("plan") and the ranks' ("ranks")."""
    # (the planner forked from the zygote, as the ranks are: not ~4 s of imports of its own)
    logs = tempfile.mkdtemp(prefix="torchmeg-plan-")
    try:
        err_path = os.path.join(logs, "err")
        planner = start([sys.executable, "-m", "torchmeg.plan", "--world", str(world), "--json",
                         str(tmp_path / "plan.json")] + common, dict(os.environ, OMP_NUM_THREADS="1"),
                        os.path.join(logs, "out"), err_path)
        try:
            run = launch_ranks([sys.executable, "-m", "torchmeg.plan", "--measure", "--json", str(tmp_path / "m")]
                               + common, world, dict(os.environ, PYTHONUNBUFFERED="1"), timeout=180)
            planner.wait(processes.bound(180))
        finally:
            if planner.poll() is None:  # (timed out, or the ranks' launch raised)
                planner.kill()
                planner.wait(30)
        err = open(err_path).read()
    finally:
        shutil.rmtree(logs, ignore_errors=True)
    assert run.returncode == 0, run.stderr[-3000:]
    assert planner.returncode == 0, err[-3000:]
    if stderr is not None:
        stderr.update(plan=err, ranks=run.stderr)
    plan = json.load(open(tmp_path / "plan.json"))
    ranks = [r["rank"] for r in plan["ranks"]] if ranks is None else ranks
    return plan, [json.load(open(tmp_path / f"m.rank{r}")) for r in ranks]


def run_one(cmd: list[str], env: dict, timeout: int) -> subprocess.CompletedProcess:
    """One process, as subprocess.run(capture_output=True, timeout=...) would."""
    logs, timeout = tempfile.mkdtemp(prefix="torchmeg-run-"), processes.bound(timeout)
    try:
        out_path, err_path = os.path.join(logs, "out"), os.path.join(logs, "err")
        p = start(cmd, env, out_path, err_path)
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
    t0, existed = time.monotonic(), os.path.exists(os.path.join(tmp_path, name))
    if nproc > 1 and not torchrun:
        p = launch_ranks([sys.executable] + train, nproc, full_env, timeout)
    elif nproc == 1:
        p = run_one([sys.executable] + train, full_env, timeout)
    else:
        p = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone",
                            f"--nproc_per_node={nproc}"] + train, cwd=ROOT, env=full_env, capture_output=True,
                           text=True, timeout=timeout)
    timeline.record_run(list(args), nproc, full_env, existed, time.monotonic() - t0)
    if check and p.returncode != 0:
        raise AssertionError(f"exit {p.returncode}: {' '.join(p.args)}\n{p.stdout[-3000:]}\n{p.stderr[-6000:]}"
                             + getattr(p, "rank_tails", ""))
    return p


def own_tmp(folder) -> dict:
    """The environment of a process whose temporary files go to `folder` (TMPDIR), so a test can see
    what it left there; inductor's kernel cache stays where it was (its default follows TMPDIR)."""
    from torch._inductor.runtime.cache_dir_utils import default_cache_dir  # (lazy: inductor's import)
    return dict(os.environ, TMPDIR=str(folder),
                TORCHINDUCTOR_CACHE_DIR=os.environ.get("TORCHINDUCTOR_CACHE_DIR") or default_cache_dir())
