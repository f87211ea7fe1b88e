"""`TORCHMEG_TEST_TIMELINE=FILE`: where the suite's time went, written by the process that reports
(xdist's controller, or the only process) when the session ends: each test phase's worker, start and
duration as JSON lines, appended (a second session, such as `.ci/run`'s capped pass, adds its rows
after the first's, each row naming its session's start); and a summary printed after pytest's own:
the seconds each file took, each worker's busy time and its idle tail (the time it waited at the end
while another still worked: what the order of files costs under `--dist loadfile`).

Not a timing assertion: a record of one run, read when the suite's time is the question
(docs/testing.md keeps the numbers)."""
from __future__ import annotations

import collections
import json
import os
import time

ENV = "TORCHMEG_TEST_TIMELINE"


class Timeline:
    def __init__(self, path: str):
        self.path, self.rows, self.session = path, [], time.time()

    def pytest_runtest_logreport(self, report):
        node = getattr(report, "node", None)  # (set by xdist on the controller: the worker it ran on)
        worker = node.gateway.id if node is not None else "main"
        self.rows.append({"test": report.nodeid, "phase": report.when, "worker": worker,
                          "start": report.start, "seconds": report.duration, "outcome": report.outcome,
                          "session": self.session})

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


def register(config) -> None:
    path = os.environ.get(ENV)
    if path and not hasattr(config, "workerinput"):  # (the controller, or a run without workers)
        config.pluginmanager.register(Timeline(path), "torchmeg-timeline")
