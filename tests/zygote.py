"""A fork server for the suite's CLI runs (as Android's zygote, or multiprocessing's forkserver).

Each `python -m torchmeg.train` the suite starts spends ~2.4 s of its ~3 s importing torch,
torch.distributed (which pulls in dynamo) and torchmeg, and ~0.3 s training: the suite's time is
its number of process launches. This server imports all of that once and forks a child per run,
which then runs the module exactly as `python -m` would (`runpy`, `__main__`, sys.argv), with the
requested environment, working folder and output files. It does no tensor work before forking,
so nothing a run reads lazily (ATen's CPU capability, MKL's and OpenMP's thread counts, oneDNN's
ISA) is fixed by the server, except what torch reads at import; so the client (`tests/launch.py`)
sends a run to a server started with the same environment but for keys read at run time
(`RUNTIME_KEYS`): one server per such environment (a few at most; past that, fresh interpreters).

Protocol, one Unix-socket connection per run: the client sends one JSON line {module or script, args,
env, cwd, stdout, stderr} (`python -m MODULE ARGS` or `python SCRIPT ARGS`); the server answers
{"pid": N} when the child is forked and {"rc": R} when it has exited (R < 0: killed by signal -R, as
subprocess reports it).

    python tests/zygote.py SOCKET_PATH
"""
from __future__ import annotations

import gc
import json
import os
import selectors
import signal
import socket
import sys

# Environment keys a run may set differently from its server's: read when the run needs them, never
# at import. The rest of the environment is the server's identity (`import_key`): a run goes to a
# server started with exactly those values (OMP_NUM_THREADS, for one, is read when torch is imported).
RUNTIME_KEYS = frozenset({
    "RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "MASTER_ADDR", "MASTER_PORT",
    "PYTHONUNBUFFERED",  # the server's streams are unbuffered already
    "TORCHMEG_CACHE", "TORCHMEG_RECORD_OPS",
    "PYTEST_CURRENT_TEST",  # pytest rewrites it for every test
})
RUNTIME_PREFIXES = ("TORCHMEG_TEST_",)


def import_key(env: dict) -> tuple:
    """The part of an environment a process may read at import: two runs with the same key behave in
    a fork of one server as they would in fresh interpreters."""
    return tuple(sorted((k, v) for k, v in env.items()
                        if k not in RUNTIME_KEYS and not k.startswith(RUNTIME_PREFIXES)))


def _child(req: dict, listener: socket.socket, conns) -> None:
    """In the forked child: become the requested `python -m MODULE ARGS` (or `python SCRIPT ARGS`) and
    never return."""
    code = 1
    try:
        os.setsid()  # a process group of its own: the suite kills the run with everything it started
        listener.close()
        for c in conns:
            c.close()
        for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGCHLD, signal.SIGPIPE):
            signal.signal(sig, signal.SIG_DFL)
        null = os.open(os.devnull, os.O_RDONLY)
        os.dup2(null, 0)
        for fd, path in ((1, req["stdout"]), (2, req["stderr"])):
            f = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
            os.dup2(f, fd)
            os.close(f)
        # A run killed by a signal it can catch (SIGABRT, SIGSEGV, SIGBUS, SIGFPE, SIGILL) writes every
        # thread's Python stack to its stderr first (then dies by the signal, as before): a rank that
        # aborted mid-run left only its peer's "connection reset" in CI's log.
        import faulthandler
        faulthandler.enable(all_threads=True)
        os.environ.clear()
        os.environ.update(req["env"])
        os.chdir(req["cwd"])
        import runpy
        try:
            if req.get("script"):  # `python SCRIPT ARGS`: the script's folder first on the path, as python sets it
                script = os.path.abspath(req["script"])
                sys.path[0] = os.path.dirname(script)
                sys.argv = [req["script"]] + list(req["args"])
                runpy.run_path(script, run_name="__main__")
            else:
                sys.path[0] = os.getcwd()  # as `python -m` sets it (the server's is tests/)
                sys.argv = [req["module"]] + list(req["args"])
                runpy.run_module(req["module"], run_name="__main__", alter_sys=True)
            code = 0
        except SystemExit as e:
            code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
            if not isinstance(e.code, (int, type(None))):
                print(e.code, file=sys.stderr)
        except BaseException:
            import traceback
            traceback.print_exc()
            code = 1
        import atexit
        atexit._run_exitfuncs()
    finally:
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except Exception:
                pass
        os._exit(code)


def _forks_can_use_cuda() -> bool:
    """Whether a fork of this process could start CUDA: torch marks a fork "bad" when its parent has
    counted devices through the CUDA runtime or initialized CUDA (a flag `torch.cuda.is_initialized()`
    does not show for the first). Asked of a fork that exits at once; always true on a CPU build."""
    import torch
    pid = os.fork()
    if pid == 0:
        os._exit(3 if torch.cuda._is_in_bad_fork() else 0)
    return os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]) == 0


def serve(path: str) -> None:
    # What every run imports; done before the first fork so each child starts with it in memory.
    import torch  # noqa: F401
    import torch.distributed  # noqa: F401
    import torchmeg.train.cli  # noqa: F401
    import torchmeg.train.trainer  # noqa: F401
    # And what a compiled run imports at its first torch.compile (~1 s): inductor's front end. On a CPU
    # build it starts no thread (a fork server must hold none), reads its settings from the environment,
    # which is this server's identity (import_key), and finds its cache folder at use, after the child
    # has set it. (transformers, which the HF workers import, is not here: its import starts a thread.)
    # Not on a GPU build of torch: there the import asks `torch.cuda.is_available()`
    # (torch/_inductor/runtime/benchmarking.py), which counts devices through the CUDA runtime, and a fork
    # of a process that did cannot use CUDA ("Cannot re-initialize CUDA in forked subprocess": the GPU
    # suite on a lent H200, torch 2.11, 2026-11-30).
    if not (torch.version.cuda or torch.version.hip):
        import torch._inductor.compile_fx  # noqa: F401
    if not _forks_can_use_cuda():  # any import that did so, named here rather than in every GPU run
        sys.exit("tests/zygote.py: an import touched CUDA (a fork of this server could not use the GPU); "
                 "leave that import to the runs, or set TORCHMEG_TEST_NO_ZYGOTE=1")
    # What the imports made lives as long as any child: moved out of the collector's sight (CPython's
    # advice for a server that forks without exec), so a child's full collections (the trainer's own at
    # its end, the automatic ones) skip ~300,000 objects (~0.2 s each time) and leave their pages shared.
    gc.freeze()

    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(path)
    listener.listen(64)
    sel = selectors.DefaultSelector()
    sel.register(listener, selectors.EVENT_READ)
    children: dict[int, socket.socket] = {}
    buffers: dict[socket.socket, bytes] = {}
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    parent = os.getppid()
    print("ready", flush=True)
    while True:
        if os.getppid() != parent:  # the test session died without closing us: do not outlive it
            sys.exit(0)
        for key, _ in sel.select(timeout=0.02):
            sock = key.fileobj
            if sock is listener:
                conn, _ = listener.accept()
                buffers[conn] = b""
                sel.register(conn, selectors.EVENT_READ)
                continue
            data = sock.recv(1 << 20)
            if not data:  # the client went away before asking
                sel.unregister(sock)
                buffers.pop(sock, None)
                sock.close()
                continue
            buffers[sock] += data
            if not buffers[sock].endswith(b"\n"):
                continue
            req = json.loads(buffers.pop(sock))
            sel.unregister(sock)
            sys.stdout.flush()
            sys.stderr.flush()
            pid = os.fork()
            if pid == 0:
                _child(req, listener, list(children.values()) + [sock])
            children[pid] = sock
            sock.sendall(json.dumps({"pid": pid}).encode() + b"\n")
        while children:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                break
            if pid == 0:
                break
            sock = children.pop(pid, None)
            if sock is not None:
                rc = os.waitstatus_to_exitcode(status)
                try:
                    sock.sendall(json.dumps({"rc": rc}).encode() + b"\n")
                except OSError:
                    pass
                sock.close()


if __name__ == "__main__":
    serve(sys.argv[1])
