"""The suite's own guarantees (tests/processes.py), shown on an inner pytest session built here:
- a test that times out leaves no process behind: its run, forked by the test zygote or started fresh,
  and the child that run started are all gone when the test ends (counted by a later test of the same
  session, before the session's own clean-up could hide a leak);
- a test not marked slow that starts a process fails, naming itself (the quick tier launches none).
Before tests/processes.py the zygote's fork of a timed-out test trained on in the background (an
orphan of the fork server), slowing every test after it."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import uuid

import pytest

from launch import ROOT, run_one

INNER = '''
import os, subprocess, sys
import pytest
from launch import run_one, zygote_for

TOKEN, STARTED = os.environ["HYGIENE_TOKEN"], os.environ["HYGIENE_STARTED"]
STUCK = [sys.executable, "-m", "tests.stuck_run", TOKEN, STARTED]


def alive():
    n = 0
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            n += TOKEN.encode() in open(f"/proc/{pid}/cmdline", "rb").read()
        except OSError:
            pass
    return n


def test_a_quick_test_that_starts_a_process():
    subprocess.run([sys.executable, "-c", "pass"])


@pytest.fixture(scope="module")
def zygote():
    zygote_for(dict(os.environ))  # started (imports) before the timed call


@pytest.mark.slow
def test_times_out_in_a_forked_run(zygote):
    run_one(STUCK, dict(os.environ), timeout=600)


@pytest.mark.slow
def test_times_out_in_a_fresh_process():
    run_one(STUCK, dict(os.environ, TORCHMEG_TEST_NO_ZYGOTE="1"), timeout=600)


def test_count():
    open(os.environ["HYGIENE_COUNT"], "w").write(str(alive()))
'''


def _alive(token: str) -> int:
    n = 0
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as fh:
                n += token.encode() in fh.read()
        except OSError:
            pass
    return n


@pytest.mark.slow
def test_a_timed_out_test_leaves_no_process_and_the_quick_tier_launches_none(tmp_path):
    token = f"torchmeg-hygiene-{uuid.uuid4().hex}"
    started, count = tmp_path / "started", tmp_path / "count"
    started.mkdir()
    (tmp_path / "test_inner.py").write_text(INNER)
    assert _alive(token) == 0
    timeline = tmp_path / "timeline.jsonl"  # (tests/timeline.py, on the inner session)
    env = dict(os.environ, HYGIENE_TOKEN=token, HYGIENE_STARTED=str(started), HYGIENE_COUNT=str(count),
               PYTHONPATH=os.pathsep.join([os.path.join(ROOT, "tests"), ROOT]), TORCHMEG_TEST_TIMELINE=str(timeline))
    env.pop("PYTEST_ADDOPTS", None)  # (the outer session's own options, e.g. a plugin on its PYTHONPATH: not the inner's)
    # The timeout covers the test's call only: the zygote starts (imports) in a fixture before it. 4 s:
    # each stuck run has started, and started its child, well inside it (a fork of that zygote; a fresh
    # interpreter that imports no torch: ~0.1 s); a longer bound is only time the suite waits.
    p = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "conftest", "-p", "no:cacheprovider",
                        "--timeout=4", "-o", "timeout_func_only=true", "--rootdir", str(tmp_path),
                        str(tmp_path / "test_inner.py")], cwd=ROOT, env=env, capture_output=True, text=True,
                       timeout=240)
    out = p.stdout + p.stderr
    assert p.returncode == 1 and "3 failed, 1 passed" in out, out[-4000:]
    assert "test_a_quick_test_that_starts_a_process starts a process" in out and "mark it @pytest.mark.slow" in out
    assert out.count("Timeout") >= 2, out[-4000:]
    assert len(os.listdir(started)) == 2  # both stuck runs ran (and started their children) before the timeout
    assert count.read_text() == "0", f"{count.read_text()} processes of the timed-out tests were still alive"
    assert _alive(token) == 0
    rows = [json.loads(line) for line in timeline.read_text().splitlines()]
    calls = {r["test"].split("::")[1]: r for r in rows if r["phase"] == "call"}
    assert len(calls) == 4 and all(r["worker"] == "main" for r in rows), rows
    assert 4 <= calls["test_times_out_in_a_forked_run"]["seconds"] < 60 and "idle tail 0 s" in out, out[-2000:]
    # each test's bound as its worker set the timer (pytest-timeout's), and the tests near theirs named
    assert {r["bound"] for r in calls.values()} == {4}, calls
    near = out[out.index("tests over 1/3 of their bound"):].splitlines()
    assert near[0].endswith(": 2") and all(" of 4 s  " in line for line in near[1:3]), out[-3000:]
    assert {line.rsplit("::", 1)[1] for line in near[1:3]} == {"test_times_out_in_a_forked_run",
                                                                 "test_times_out_in_a_fresh_process"}, out[-3000:]


@pytest.mark.timeout(200)
def test_a_wait_is_bounded_by_the_time_left_to_the_test():
    """A helper's timeout is a floor: a run waited for may take what is left of the test's own
    pytest-timeout, less a margin (a cold compile beside another worker's tests ran past 120 s on CI
    and failed a green run); a longer floor stays; subprocess.run is bounded alike."""
    import processes
    assert 200 - 25 < processes.bound(5) < 200 - 15
    assert processes.bound(500) == 500
    assert subprocess.run is processes._bounded_run


@pytest.mark.slow
def test_a_run_killed_by_abort_says_where():
    """A run forked by the test zygote that dies by SIGABRT (a gloo or C++ abort mid-run) writes every
    thread's Python stack to its stderr before it dies, and still reports the signal: in CI a rank
    that aborted left only its peer's "connection reset" (tests/zygote.py enables faulthandler)."""
    p = run_one([sys.executable, "-m", "tests.aborted_run"], dict(os.environ), timeout=60)
    assert p.returncode == -signal.SIGABRT, (p.returncode, p.stderr[-2000:])
    assert "Fatal Python error: Aborted" in p.stderr and 'aborted_run.py", line 11 in abort_here' in p.stderr, \
        p.stderr[-2000:]


def test_the_timeline_names_the_runs_a_test_run_repeats(tmp_path, monkeypatch):
    """TORCHMEG_TEST_TIMELINE's runs file: each CLI run keyed by its arguments (less its own folder),
    ranks, environment and whether it resumed; a key run twice costs its second run's seconds, a
    resume of the same arguments is another key, and a run of another session is not counted."""
    import time
    import timeline
    path = tmp_path / "t.jsonl"
    monkeypatch.setenv(timeline.ENV, str(path))
    monkeypatch.setenv("PYTEST_CURRENT_TEST", "old::w (call)")
    timeline.record_run(["--training.steps=4"], 1, {}, False, 9.0)  # an earlier session's (the README pass)
    time.sleep(0.01)
    plugin = timeline.Timeline(str(path))
    for test, args, resumed, secs in [("a::x", ["--training.steps=4"], False, 3.0),
                                      ("b::y", ["--training.steps=4"], False, 2.5),
                                      ("b::y", ["--training.steps=4"], True, 1.0),
                                      ("c::z", ["--training.steps=8"], False, 5.0)]:
        monkeypatch.setenv("PYTEST_CURRENT_TEST", f"{test} (call)")
        timeline.record_run(args, 1, dict(os.environ, **({"KILL_AT": "10"} if test == "c::z" else {})), resumed, secs)
    rows = [json.loads(line) for line in open(str(path) + ".runs")]
    assert [r["test"] for r in rows] == ["old::w", "a::x", "b::y", "b::y", "c::z"]
    assert [r["env"] for r in rows[1:]] == [{}, {}, {}, {"KILL_AT": "10"}]  # (only what differs from the suite's)
    (secs, n, tests, first), = timeline.repeats(rows[1:])
    assert (secs, n, tests) == (2.5, 2, ["a::x", "b::y"]) and first["args"] == ["--training.steps=4"]

    class Reporter:
        lines: list = []

        def write_line(self, line):
            self.lines.append(line)
    plugin.rows = [{"test": "a::x", "phase": "call", "worker": "gw0", "start": plugin.session, "seconds": 3.0,
                    "outcome": "passed", "session": plugin.session}]
    plugin.pytest_terminal_summary(Reporter())
    runs = next(line for line in Reporter.lines if "CLI runs" in line)
    assert "CLI runs: 4, 12 s; the same run repeated: 1 runs, 2 s of repeats" in runs, Reporter.lines
