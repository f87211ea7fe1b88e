"""Every process a test starts ends with the test, and the quick tier starts none.

Each process the suite starts (subprocess.Popen from any test or helper, a fork of the test zygote)
leads a process group of its own (`start_new_session`; the zygote's children call setsid), and the
group is recorded against the test phase that started it:
- a test's call phase: every group it started is killed (SIGKILL to the group: the CLI, its ranks,
  torchrun's workers, the inductor workers they spawned) when the call ends, passed, failed or timed
  out (pytest-timeout raises in the test; the kill runs after). A run the test waited for is gone
  already; only what a failure or a timeout left behind is killed;
- a fixture's setup (a server a module's tests share): killed if the setup fails, else left to the
  fixture's own teardown; whatever is still alive when the session ends is killed then.
The test zygotes (launch.Zygote: fork servers kept for the whole session) are started under
`keep()` and are not recorded; torch's inductor compile-worker pool is torch's own and kept too.

A process a test waits for is bounded by the test's own time (`bound`): the helpers' timeouts
(launch.run_cli and the launches under it, subprocess.run) are floors, raised to what is left of the
test's pytest-timeout less a margin, so a run slowed by a busy machine fails only when the test itself
would, and then with its output (CI's 120 s bound on a cold compile beside another worker's tests
failed a green run).

The quick tier: a test not marked `slow` that starts a process fails at once, naming itself, so
`-m "not slow"` launches nothing (the rule holds in the whole suite's run too, where it is checked).
"""
from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import threading
import time

import pytest

_state = threading.local()
_groups: dict[str, set[int]] = {"call": set(), "setup": set(), "session": set()}
_lock = threading.Lock()
_current = {"item": None, "phase": "session"}
_popen_init = subprocess.Popen.__init__
_run = subprocess.run
_deadline: list[float | None] = [None]  # when the current test's pytest-timeout fires (monotonic)


@contextlib.contextmanager
def keep():
    """Processes started inside live on (the session's fork servers)."""
    _state.keep = True
    try:
        yield
    finally:
        _state.keep = False


def _torch_internal() -> bool:
    f = sys._getframe(2)
    while f is not None:
        name = f.f_code.co_filename
        if "torch/_inductor" in name or "torch/utils/_triton" in name:
            return True
        f = f.f_back
    return False


def launching(what: str) -> None:
    """Called before a process starts: refuses in a quick-tier test."""
    item = _current["item"]
    if item is not None and item.get_closest_marker("slow") is None:
        raise RuntimeError(f"{item.nodeid} starts a process ({what}) but is not marked slow: the quick tier "
                           f"(-m \"not slow\") launches none; mark it @pytest.mark.slow")


def started(pid: int) -> None:
    """Record the group a new process leads against the phase that started it."""
    if getattr(_state, "keep", False):
        return
    with _lock:
        _groups[_current["phase"] if _current["item"] is not None else "session"].add(pid)


def _init(self, args, *a, **kw):
    internal = getattr(_state, "keep", False) or _torch_internal()
    if not internal:
        launching(str(args if isinstance(args, str) else " ".join(map(str, args)))[:200])
        kw.setdefault("start_new_session", True)
    _popen_init(self, args, *a, **kw)
    if not internal:
        started(self.pid)


def bound(asked: float | None) -> float | None:
    """The timeout to wait for a process with: `asked`, or what is left of the test's pytest-timeout
    less a margin (a tenth of it, at most 20 s: time to kill the run and report its output) when
    that is longer. Outside a timed test, `asked`."""
    deadline = _deadline[0]
    if deadline is None or asked is None:
        return asked
    left = deadline - time.monotonic()
    return max(asked, left - min(20.0, 0.1 * left))


def _bounded_run(*args, **kw):
    if kw.get("timeout") is not None:
        kw["timeout"] = bound(kw["timeout"])
    return _run(*args, **kw)


@pytest.hookimpl(tryfirst=True)
def pytest_timeout_set_timer(item, settings):
    _deadline[0] = time.monotonic() + settings.timeout  # (None returned: pytest-timeout sets its timer)


@pytest.hookimpl(tryfirst=True)
def pytest_timeout_cancel_timer(item):
    _deadline[0] = None


def kill_groups(phase: str) -> int:
    """SIGKILL every group recorded for `phase`; how many still had a process."""
    with _lock:
        pids, _groups[phase] = _groups[phase], set()
    alive = 0
    for pid in pids:
        for kill in (os.killpg, os.kill):  # a fork that had not yet called setsid has no group of its own
            try:
                kill(pid, signal.SIGKILL)
                alive += kill is os.killpg
            except (ProcessLookupError, PermissionError):
                pass
    return alive


def install() -> None:
    subprocess.Popen.__init__ = _init
    subprocess.run = _bounded_run


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_setup(item):
    _current.update(item=item, phase="setup")
    outcome = yield
    if outcome.excinfo is not None:
        kill_groups("setup")
    else:
        _to_session()


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_call(item):
    with _phase(item, "call", lambda: kill_groups("call")):
        yield


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_teardown(item):
    with _phase(item, "setup", _to_session):  # (a fixture's teardown: as its setup)
        yield
    _current.update(item=None, phase="session")


@contextlib.contextmanager
def _phase(item, phase: str, after):
    _current.update(item=item, phase=phase)
    try:
        yield
    finally:
        after()


def _to_session() -> None:
    """The fixtures' processes (set up or torn down): theirs to end, the session's if they do not."""
    with _lock:
        _groups["session"] |= _groups["setup"]
        _groups["setup"] = set()


def pytest_sessionfinish(session, exitstatus):
    kill_groups("session")
