"""`TORCHMEG_TEST_TIMELINE=FILE`: where the suite's time went, written by the process that reports
(xdist's controller, or the only process) when the session ends: each test phase's worker, start and
duration as JSON lines, appended (a second session, such as `.ci/run`'s capped pass, adds its rows
after the first's, each row naming its session's start); and a summary printed after pytest's own:
the seconds each file took, each worker's busy time and its idle tail (the time it waited at the end
while another still worked: what the order of files costs under `--dist loadfile`); and the CLI runs
that ran more than once with the same arguments (FILE.runs: each `launch.run_cli` run's arguments less
its dump folder and job name, ranks, environment beyond the suite's, whether its folder existed (a
resume), seconds, test), the seconds their repeats cost: what a run trained once per test run
(conftest.trained_once) would save. And the tests whose time came within a third of their bound
(pytest-timeout's, each worker recording it as its timer starts): a bound exists to end a hang, and
one less than 3x a test's time on a quiet machine is a timing assertion on a busy one (a loaded run
was 1.3-2x slower than a quiet one).

Not a timing assertion: a record of one run, read when the suite's time is the question
(docs/testing.md keeps the numbers)."""
from __future__ import annotations

import collections
import json
import os
import time

ENV = "TORCHMEG_TEST_TIMELINE"
MARGIN = 3  # a test's bound at least this many times its time (see above)


def record_run(args: list[str], nproc: int, env: dict, resumed: bool, seconds: float) -> None:
    """One CLI run (`env`: its whole environment), appended to FILE.runs by the process that ran it
    (any worker; one short line per write, appended whole)."""
    path = os.environ.get(ENV)
    if not path:
        return
    row = {"args": args, "nproc": nproc, "env": {k: v for k, v in env.items() if os.environ.get(k) != v},
           "resumed": resumed, "seconds": round(seconds, 2), "end": time.time(),
           "test": os.environ.get("PYTEST_CURRENT_TEST", "?").rsplit(" ", 1)[0]}
    with open(path + ".runs", "a") as f:
        f.write(json.dumps(row) + "\n")


def repeats(rows: list[dict]) -> list[tuple[float, int, list[str], dict]]:
    """Runs of the same arguments, ranks, environment and resume, run more than once -> (seconds of the
    runs after the first, count, tests, the first run's row), costliest first."""
    by_key = collections.defaultdict(list)
    for r in rows:
        by_key[json.dumps([r["args"], r["nproc"], sorted(r["env"].items()), r["resumed"]])].append(r)
    out = [(sum(r["seconds"] for r in rs[1:]), len(rs), sorted({r["test"] for r in rs}), rs[0])
           for rs in by_key.values() if len(rs) > 1]
    return sorted(out, key=lambda x: -x[0])


class Bounds:
    """On every process that runs tests: each test's pytest-timeout bound, in its reports'
    user_properties (which xdist carries to the controller)."""

    @staticmethod
    def pytest_timeout_set_timer(item, settings):
        if settings.timeout:
            item.user_properties.append(("timeout", settings.timeout))


def near_bounds(rows: list[dict]) -> list[tuple[float, float, str]]:
    """(seconds, bound, test) of the tests whose phases together took more than 1/MARGIN of their
    bound, nearest first."""
    secs, bounds = collections.Counter(), {}
    for r in rows:
        secs[r["test"]] += r["seconds"]
        if r.get("bound"):
            bounds[r["test"]] = r["bound"]
    return sorted(((secs[t], b, t) for t, b in bounds.items() if secs[t] * MARGIN > b), key=lambda x: -x[0] / x[1])


class Timeline:
    def __init__(self, path: str):
        self.path, self.rows, self.session = path, [], time.time()

    def pytest_runtest_logreport(self, report):
        node = getattr(report, "node", None)  # (set by xdist on the controller: the worker it ran on)
        worker = node.gateway.id if node is not None else "main"
        self.rows.append({"test": report.nodeid, "phase": report.when, "worker": worker,
                          "start": report.start, "seconds": report.duration, "outcome": report.outcome,
                          "session": self.session, "bound": dict(report.user_properties).get("timeout")})

    def pytest_terminal_summary(self, terminalreporter):
        if not self.rows:
            return
        with open(self.path, "a") as f:
            f.writelines(json.dumps(r) + "\n" for r in self.rows)
        write = terminalreporter.write_line
        t0 = min(r["start"] for r in self.rows)
        end = {w: max(r["start"] + r["seconds"] - t0 for r in self.rows if r["worker"] == w)
               for w in {r["worker"] for r in self.rows}}
        busy = collections.Counter()
        files = collections.Counter()
        for r in self.rows:
            busy[r["worker"]] += r["seconds"]
            files[r["test"].split("::")[0]] += r["seconds"]
        last = max(end.values())
        write(f"timeline ({os.path.abspath(self.path)}): {len(self.rows)} phases over {last:.0f} s")
        for w in sorted(end):
            write(f"  worker {w}: busy {busy[w]:.0f} s, done at {end[w]:.0f} s, idle tail {last - end[w]:.0f} s")
        write("  slowest files (seconds of their tests):")
        for name, s in files.most_common(20):
            write(f"    {s:8.1f}  {name}")
        near = near_bounds(self.rows)
        write(f"  tests over 1/{MARGIN} of their bound (pytest-timeout; raise the bound or cut the test): {len(near)}")
        for secs, b, test in near:
            write(f"    {secs:8.1f}  of {b:.0f} s  {test}")
        if os.path.exists(self.path + ".runs"):
            with open(self.path + ".runs") as f:
                runs = [r for r in map(json.loads, f) if r["end"] >= self.session]
            rep = repeats(runs)
            write(f"  CLI runs: {len(runs)}, {sum(r['seconds'] for r in runs):.0f} s; the same run repeated: "
                  f"{len(rep)} runs, {sum(x[0] for x in rep):.0f} s of repeats")  # (runs: distinct keys)
            for secs, n, tests, r in rep[:10]:
                write(f"    {secs:8.1f}  x{n} in {len(tests)} tests ({', '.join(tests[:2])[:160]}, ...): {r['nproc']} rank(s)"
                      f"{', resumed' if r['resumed'] else ''}{', env ' + str(r['env']) if r['env'] else ''}, "
                      f"...{' '.join(r['args'])[-240:]}")


def register(config) -> None:
    path = os.environ.get(ENV)
    if path:
        config.pluginmanager.register(Bounds(), "torchmeg-timeline-bounds")
    if path and not hasattr(config, "workerinput"):  # (the controller, or a run without workers)
        config.pluginmanager.register(Timeline(path), "torchmeg-timeline")
