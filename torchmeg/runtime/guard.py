"""Run guards: a failure on one rank ends the whole job in seconds, a hung step is dumped and ended.

Fail fast. The failing rank records "rank R: <error>" in the job's store, prints its traceback once
(tagged with its rank) and leaves at once with `os._exit` — no barrier, no collective: the peers it
would wait for may be the ones that are stuck. Its sockets close with it, so a peer blocked in a
gloo collective or p2p receive gets "connection closed" within moments (NCCL ranks abort their
communicators first); that peer finds the record in the store, prints one line naming the rank
that failed, and leaves too. Under torchrun the agent also stops the survivors and, with
`--max-restarts`, restarts the group, which resumes from the newest checkpoint.

Watchdog. A daemon thread per rank times the phase the loop is in (a training step, an
evaluation, a checkpoint save or load). A training step may take `watchdog_factor` x the median
of the recent steps, never less than `watchdog_min_s`; the first steps (compilation) and the other
phases get `watchdog_startup_s`. Past that, every rank's own watchdog fires — the hung rank and the
peers waiting for it alike — dumps all Python stacks and the pipeline action in flight, and exits
non-zero. No rank waits for the collective timeout.
"""
from __future__ import annotations

import contextlib
import faulthandler
import os
import statistics
import sys
import threading
import time
import traceback

import torch.distributed as dist
from torch.distributed.distributed_c10d import _abort_process_group

from torchmeg.config.errors import ConfigError, InputError

FAILED_KEY = "torchmeg/failed"
EXIT_FAILED, EXIT_CONFIG, EXIT_HUNG = 1, 2, 3

_STORE_GONE = "the rank hosting the job's store (rank 0) is gone"
_store = None  # the job's store (set by runtime.init_distributed); may be gone if its host died


def set_store(store) -> None:
    global _store
    _store = store


def job_store():
    """The job's store (None before a process group exists)."""
    return _store


def _peer_failure() -> str | None:
    """The failure another rank recorded, if any (best effort: its host may have died)."""
    if _store is None:
        return None
    try:
        if _store.check([FAILED_KEY]):
            return _store.get(FAILED_KEY).decode()
    except Exception:  # noqa: BLE001 - the store's host may be the rank that failed
        return _STORE_GONE
    return None


def _record_failure(text: str) -> None:
    if _store is None:
        return
    try:
        _store.compare_set(FAILED_KEY, "", text)  # first failure wins
    except Exception:  # noqa: BLE001
        pass


def report_failure(exc: BaseException, rank: int) -> None:
    """Print the root cause once (tagged with the rank), or one line if a peer failed first."""
    peer = _peer_failure()
    if peer == _STORE_GONE:  # cannot tell whether rank 0 failed first: report this rank's own error
        peer = None
    if peer is not None and not peer.startswith(f"rank {rank}:"):
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        print(f"torchmeg: rank {rank}: stopping because {peer} ({type(exc).__name__}: {first[:200]})",
              file=sys.stderr, flush=True)
        if " hung in " in peer:  # where this rank was waiting for the hung one is part of the diagnosis
            tb = traceback.format_tb(exc.__traceback__)
            print("".join(f"[rank {rank}] {line}\n" for line in "".join(tb).rstrip().splitlines()),
                  end="", file=sys.stderr, flush=True)
        return
    msg = f"{type(exc).__name__}: {exc}".strip()
    _record_failure(f"rank {rank}: {msg.splitlines()[0][:500]}")
    tb = "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))
    tagged = "".join(f"[rank {rank}] {line}\n" for line in tb.rstrip().splitlines())
    print(f"torchmeg: rank {rank} failed: {msg.splitlines()[0] if msg else ''}\n{tagged}", end="",
          file=sys.stderr, flush=True)


def hard_exit(code: int) -> None:
    """Leave now: abort NCCL communicators (bounded), flush, and skip interpreter teardown, whose
    destructors would wait on peers that are gone or stuck."""

    def _abort():
        try:
            if dist.is_initialized() and "nccl" in str(dist.get_backend()):
                _abort_process_group()
        except Exception:  # noqa: BLE001 - leaving anyway
            pass

    t = threading.Thread(target=_abort, daemon=True)
    t.start()
    t.join(timeout=5.0)
    for s in (sys.stdout, sys.stderr):
        try:
            s.flush()
        except Exception:  # noqa: BLE001
            pass
    os._exit(code)


class Watchdog:
    """Ends the process (exit 3) if the current phase runs far past what earlier steps took."""

    def __init__(self, cfg, rank: int, describe_inflight=None):
        t = cfg.training
        self.factor, self.min_s, self.startup_s = t.watchdog_factor, t.watchdog_min_s, t.watchdog_startup_s
        self.rank, self.describe_inflight = rank, describe_inflight
        self.enabled = self.factor > 0
        self._phase, self._t0, self._limit = None, 0.0, 0.0
        self._times: list[float] = []
        self._lock = threading.Lock()
        if self.enabled:
            threading.Thread(target=self._watch, name="torchmeg-watchdog", daemon=True).start()

    def limit_for(self, phase: str) -> float:
        if phase.startswith("step") and len(self._times) >= 3:
            return max(self.min_s, self.factor * statistics.median(self._times[-50:]))
        return max(self.min_s, self.startup_s)

    def begin(self, phase: str) -> None:
        with self._lock:
            self._phase, self._t0, self._limit = phase, time.monotonic(), self.limit_for(phase)

    def end(self) -> None:
        with self._lock:
            if self._phase and self._phase.startswith("step"):
                self._times.append(time.monotonic() - self._t0)
            self._phase = None

    @contextlib.contextmanager
    def inside(self, phase: str):
        """A phase within the current one (GRPO's rollouts within a step), with its own limit; the outer
        phase resumes after it, its clock not counting the inner one's time."""
        with self._lock:
            outer, t0 = (self._phase, self._t0, self._limit), time.monotonic()
            self._phase, self._t0, self._limit = phase, t0, self.limit_for(phase)
        try:
            yield
        finally:
            with self._lock:
                self._phase, self._t0, self._limit = outer[0], outer[1] + (time.monotonic() - t0), outer[2]

    def _watch(self) -> None:
        while True:
            time.sleep(0.5)
            with self._lock:
                phase, elapsed, limit = self._phase, time.monotonic() - self._t0, self._limit
            if phase is not None and elapsed > limit:
                self._fire(phase, elapsed, limit)

    def _fire(self, phase: str, elapsed: float, limit: float) -> None:
        median = f"{statistics.median(self._times[-50:]):.2f} s" if self._times else "n/a"
        print(f"torchmeg: rank {self.rank}: {phase} has run {elapsed:.0f} s, past the watchdog limit of "
              f"{limit:.0f} s (median step {median}; training.watchdog_factor / watchdog_min_s / "
              f"watchdog_startup_s); dumping stacks and exiting", file=sys.stderr, flush=True)
        if self.describe_inflight is not None:
            try:
                print(f"torchmeg: rank {self.rank}: {self.describe_inflight()}", file=sys.stderr, flush=True)
            except Exception:  # noqa: BLE001
                pass
        faulthandler.dump_traceback(file=sys.stderr, all_threads=True)
        _record_failure(f"rank {self.rank}: hung in {phase} ({elapsed:.0f} s)")
        hard_exit(EXIT_HUNG)


def inject_fault(step: int, rank: int) -> None:
    """Tests: TORCHMEG_TEST_RAISE_AT_STEP / TORCHMEG_TEST_HANG_AT_STEP = N (+ TORCHMEG_TEST_FAULT_RANK,
    default 0) make that rank raise, or block forever, inside step N — on torchrun's first attempt
    only, so a restarted group can show that it resumes."""
    if (os.environ.get("TORCHMEG_TEST_FAULT_RANK", "0") != str(rank)
            or os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") != "0"):
        return
    if os.environ.get("TORCHMEG_TEST_RAISE_AT_STEP") == str(step):
        raise RuntimeError(f"injected failure at step {step} on rank {rank}")
    if os.environ.get("TORCHMEG_TEST_HANG_AT_STEP") == str(step):
        while True:
            time.sleep(1.0)


def cli_main(prog: str, prepare, run, stops: tuple = ()) -> int:
    """The exit policy every torchmeg CLI shares. `prepare()` checks what can be checked before a
    process group exists (a ConfigError there: one line from rank 0, exit 2); `run(prepared)` does
    the work and ends its process group itself. After start-up a ConfigError (a check that needs the
    data, the device or a checkpoint) is still one line and exit 2, an error in `stops` (a run told to
    stop: every rank alike) one line and exit 1, anything else on any rank ends the job now (exit 1,
    the root cause printed once). Exit codes: 0 done, 1 failed, 2 bad input, 3 hang (watchdog)."""
    rank = int(os.environ.get("RANK", "0"))
    try:
        prepared = prepare()
    except ConfigError as e:
        if rank == 0:  # every rank fails alike; one of them says why
            print(f"{prog}: error: {e}", file=sys.stderr, flush=True)
        else:
            # ...and the others leave a moment later: a launcher (torchrun) stops every worker as
            # soon as one exits, which could kill rank 0 before its line is out (seen 1 in ~200).
            time.sleep(3)
        return EXIT_CONFIG
    try:
        run(prepared)
        return 0
    except ConfigError as e:
        if rank == 0:
            print(f"{prog}: error: {e}", file=sys.stderr, flush=True)
        else:
            time.sleep(3)  # as in prepare(): rank 0's line goes out before a launcher stops it
        code = EXIT_CONFIG
    except stops as e:
        if rank == 0:
            print(f"{prog}: stopped: {e}", file=sys.stderr, flush=True)
        code = EXIT_FAILED
    except InputError as e:  # met by this rank alone: it says why; peers report it as the cause they stop for
        _record_failure(f"rank {rank}: {e}")
        print(f"{prog}: error: {e}", file=sys.stderr, flush=True)
        if rank == 0:
            time.sleep(2)  # rank 0 holds the store: peers meeting the same input record it before it goes
        code = EXIT_CONFIG
    except BaseException as e:  # noqa: BLE001 - any failure on any rank ends the job now
        report_failure(e, rank)
        code = EXIT_FAILED
    hard_exit(code)  # no barrier, no teardown: peers may be gone or stuck
    return code


def exit_now(code: int) -> None:
    """Leave a finished CLI without interpreter teardown: a gloo work object that outlives
    destroy_process_group() and is destroyed while the interpreter shuts down needs the GIL and
    aborts the process ("terminate called without an active exception", SIGABRT; measured on 2/100
    FSDP2 runs before this). Everything that must reach disk was closed and flushed before."""
    for stream in (sys.stdout, sys.stderr):
        stream.flush()
    os._exit(code)
