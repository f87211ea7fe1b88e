"""Process-level plumbing of a run: the device, the process group (on a per-attempt store),
the agreed SIGTERM stop, and the fault-injection hooks the tests use."""
from __future__ import annotations

import contextlib
import ctypes
import datetime
import gc
import os
import signal
import time

import torch
import torch.distributed as dist

from torchmeg.config.errors import ConfigError
from torchmeg.runtime import guard
from torchmeg.config.support import device_type


def pick_device(cfg) -> torch.device:
    if device_type(cfg) == "cuda":
        dev = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
        torch.cuda.set_device(dev)
        return dev
    return torch.device("cpu")


def set_matmul_precision(cfg, device: torch.device) -> None:
    """training.tf32 on CUDA: fp32 matmuls (and cuDNN convolutions) on TF32 tensor cores, 8x the
    fp32 rate on A100/H100 at a 10-bit mantissa, as every GPU trainer sets (torch's default has been
    off since 1.12). Global flags, no CUDA call; CPU runs are left as they are."""
    if device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = cfg.training.tf32
        torch.backends.cudnn.allow_tf32 = cfg.training.tf32


def keep_freed_memory() -> bool:
    """glibc returns every freed block over its mmap threshold to the kernel, and a training step
    frees and reallocates the same activations each step: each comes back as fresh zeroed pages,
    one page fault per 4 KiB (an [8, 512, 768] fp32 product took 3-4 ms instead of 1.4 ms). Raising
    the threshold to glibc's largest (32 MiB) and trimming only beyond 2 GiB free keeps such blocks
    in the heap for reuse. Measured on the side-by-side job: +1-3% tokens/s (eager and FSDP2), ~5%
    more resident memory. -> whether it applied (glibc only; elsewhere nothing changes)."""
    global FREED_MEMORY_KEPT
    try:
        libc = ctypes.CDLL("libc.so.6")
    except OSError:
        return False
    M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3  # malloc.h
    FREED_MEMORY_KEPT = libc.mallopt(M_MMAP_THRESHOLD, 32 << 20) == 1 and \
        libc.mallopt(M_TRIM_THRESHOLD, (1 << 31) - 1) == 1
    return FREED_MEMORY_KEPT


FREED_MEMORY_KEPT = False  # whether keep_freed_memory applied in this process (the run header says so)


@contextlib.contextmanager
def collectives_in_one_thread():
    """Run large CPU collectives (DCP's exchanges of plans and metadata) with torch's thread count
    at 1. gloo's worker threads run tensor copies; a worker thread's first large op fixes its
    OpenMP team size from torch's global thread count, and a second team (the main one already
    uses every core) puts libgomp over its CPU count, after which every thread waiting at a
    parallel region spins ~100 times instead of ~300,000 before it sleeps: each op over a mid-sized
    tensor then pays a futex wake-up. Measured on the debug recipe: -15% tokens/s for the rest of
    the run after its first checkpoint save (optimizer elementwise ops 5x slower). With the count at
    1 while the worker threads first meet a large tensor they stay single-threaded for good."""
    n = torch.get_num_threads()
    if n > 1:
        torch.set_num_threads(1)
    try:
        yield
    finally:
        if n > 1:
            torch.set_num_threads(n)


def start(cfg, dims) -> tuple[torch.device, object, object]:
    """A run's process-level start: the device, the process group, the seed, the meshes
    (dims.build_mesh / build_ep_mesh). -> (device, mesh, ep_mesh or None)."""
    device = pick_device(cfg)
    set_matmul_precision(cfg, device)
    if device.type == "cpu" and cfg.job.cpu_keep_freed_memory:
        keep_freed_memory()
    init_distributed(device, cfg.comm.init_timeout_seconds)
    torch.manual_seed(cfg.job.seed)
    return device, dims.build_mesh(device.type), dims.build_ep_mesh(device.type)


def end() -> None:
    """The clean end of a successful run: one barrier, so no rank tears down its sockets while a
    peer still talks to it, then the groups go (the caller released what held communication work)."""
    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()


def finish_script() -> None:
    """The end of a script that ran collectives outside the CLIs (a test worker, a bench), after
    its main() returned: what main() left in reference cycles (DTensors, functional-collective
    works, autograd graphs holding them) is collected while the interpreter is whole, then end(),
    then the process leaves without interpreter teardown (guard.exit_now). A gloo work that
    teardown destroys aborts the process ('terminate called without an active exception',
    SIGABRT): seen once in CI, tests/doc_mask_worker.py cp2_allgather, where the run itself had passed."""
    gc.collect()
    end()
    guard.exit_now(0)


def init_distributed(device: torch.device, timeout_s: float) -> None:
    """Always a process group (a world of 1 too), so one code path serves every layout. Its timeout
    (and the store's) is comm.init_timeout_seconds; CollectiveTimeouts shortens it in steady steps."""
    timeout = datetime.timedelta(seconds=timeout_s)
    backend = "cpu:gloo,cuda:nccl" if device.type == "cuda" else "gloo"
    if "RANK" in os.environ:
        kw = {"device_id": device} if device.type == "cuda" else {}
        rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
        # torchrun's c10d rendezvous shares its agent's TCPStore with the workers across restarts,
        # and process-group keys are the same in every attempt: without a per-attempt prefix a
        # restarted rank reads its dead peer's address ("connectFullMesh ... Connection refused";
        # measured, torch 2.13). A store of our own (rank 0 hosts it: torchmeg.launch's default,
        # which lets a replaced node rejoin) is fresh every attempt and needs none, and a replaced
        # node's agent counts its restarts from 0 while its peers do not.
        agent_store = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
        store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), world,
                              is_master=rank == 0 and not agent_store, timeout=timeout)
        if agent_store:
            store = dist.PrefixStore(f"torchmeg/attempt_{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}", store)
        dist.init_process_group(backend, store=store, rank=rank, world_size=world, timeout=timeout, **kw)
    else:
        store = dist.HashStore()
        dist.init_process_group(backend, store=store, rank=0, world_size=1, timeout=timeout)
    guard.set_store(store)  # where a failing rank leaves its error for the others


class CollectiveTimeouts:
    """The process groups' timeout per phase of the loop: comm.init_timeout_seconds while ranks may
    wait on each other for long (start-up, the first steps, evaluation, checkpoint I/O),
    comm.train_timeout_seconds in steady steps -- never below 1.25 x the watchdog's step limit, which
    grows with the median step, so the watchdog always speaks first. Set on every group this process
    has (the mesh's too) but `keep_long` (an async checkpoint's group: its writes run under steps).
    Made once the run's groups exist: it first sets the long limit on all of them (torch gives a
    group made after init_process_group its backend's default, 30 min on gloo, not the init's)."""

    def __init__(self, cfg, keep_long=()):
        self.init_s, self.train_s = cfg.comm.init_timeout_seconds, cfg.comm.train_timeout_seconds
        self.keep_long = [g for g in keep_long if g is not None]
        self.current = self.init_s
        self._apply(self.init_s, every=True)

    def steady(self, watchdog_limit_s: float) -> None:
        self._set(max(self.train_s, 1.25 * watchdog_limit_s))

    def long(self) -> None:
        self._set(self.init_s)

    def _set(self, seconds: float) -> None:
        if abs(seconds - self.current) <= 0.1 * self.current:
            return  # unchanged (within 10%): no call into every backend each step
        self.current = seconds
        self._apply(seconds)

    def _apply(self, seconds: float, every: bool = False) -> None:
        td = datetime.timedelta(seconds=seconds)
        # torch.distributed.set_timeout from torch 2.14 on; _set_pg_timeout, its older name (deprecated there)
        set_timeout = getattr(dist, "set_timeout", None) or dist.distributed_c10d._set_pg_timeout
        for group in list(dist.distributed_c10d._world.pg_map):  # torch has no public list of groups
            if every or all(group is not g for g in self.keep_long):
                set_timeout(td, group)


class StopFlag:
    """SIGTERM (pre-emption) sets a flag; ranks agree on it after each step, so all stop together."""

    def __init__(self):
        self.flag = False
        signal.signal(signal.SIGTERM, self._set)

    def _set(self, *_):
        self.flag = True

    def agreed(self) -> bool:
        t = torch.tensor([1.0 if self.flag else 0.0])
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        return bool(t.item())


def nodes() -> tuple[int, int, int]:
    """(nodes in the job, ranks per node, this node's index) from torchrun's environment."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    local = int(os.environ.get("LOCAL_WORLD_SIZE", str(world)))
    return max(1, world // local), local, int(os.environ.get("GROUP_RANK", "0"))


def on_each_node(work, what: str):
    """`work()` on each node's local rank 0 while the node's other ranks wait (a cache built once per
    node), every rank then learning every node's outcome through the job's store — no collective, so
    a ConfigError there (bad data) leaves no peer in a barrier: every rank raises it (the CLI prints it
    once, from rank 0; every rank exits 2). Rank 0 hosts the store, so it leaves after every rank has
    read (waiting a bounded time). -> work()'s result on a node's local rank 0, else None."""
    store, (n_nodes, _, node) = guard.job_store(), nodes()
    rank, world = int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1"))
    if store is None or world == 1:
        return work()
    keys = [f"torchmeg/{what}/node{n}" for n in range(n_nodes)]
    result = None
    if int(os.environ.get("LOCAL_RANK", "0")) == 0:
        outcome = "ok"
        try:
            result = work()
        except ConfigError as e:
            outcome = f"error:{e}"
        store.set(keys[node], outcome)
    store.wait(keys)  # bounded by the store's timeout (comm.init_timeout_seconds)
    errors = [v[len("error:"):] for v in (store.get(k).decode() for k in keys) if v != "ok"]
    read = store.add(f"torchmeg/{what}/read", 1)
    if errors:
        deadline = time.monotonic() + 10
        while rank == 0 and read < world and time.monotonic() < deadline:
            time.sleep(0.02)
            read = store.add(f"torchmeg/{what}/read", 0)
        raise ConfigError(errors[0])
    return result


def inject_nan(step: int) -> bool:
    """Test hook: TORCHMEG_TEST_NAN_AT_STEP=N makes step N's loss NaN."""
    return os.environ.get("TORCHMEG_TEST_NAN_AT_STEP") == str(step)


def inject_spike(step: int) -> float:
    """Test hook: TORCHMEG_TEST_SPIKE_AT_STEP=N scales step N's loss (and so its gradients) by 50."""
    return 50.0 if os.environ.get("TORCHMEG_TEST_SPIKE_AT_STEP") == str(step) else 1.0


def inject_kill(step: int, rank: int) -> None:
    """Test hook: TORCHMEG_TEST_KILL_AT_STEP=N (+ _RANK) SIGKILLs one rank after step N, on the
    first attempt only (torchrun counts restarts in TORCHELASTIC_RESTART_COUNT)."""
    if (os.environ.get("TORCHMEG_TEST_KILL_AT_STEP") == str(step)
            and os.environ.get("TORCHMEG_TEST_KILL_RANK", "0") == str(rank)
            and os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0"):
        os.kill(os.getpid(), signal.SIGKILL)


def inject_node_loss(step: int, fresh: bool) -> None:
    """Test hook: TORCHMEG_TEST_KILL_NODE_AT_STEP=N (+ TORCHMEG_TEST_KILL_NODE, a GROUP_RANK, default
    1, or `any`: every node whose agent has these variables): every worker of that node SIGKILLs its
    launcher agent and itself after step N: the node is lost. Only in a run that started fresh: a
    resumed one (on a replacement node too) goes on."""
    if (os.environ.get("TORCHMEG_TEST_KILL_NODE_AT_STEP") == str(step) and fresh
            and os.environ.get("TORCHMEG_TEST_KILL_NODE", "1") in ("any", os.environ.get("GROUP_RANK"))):
        os.kill(os.getppid(), signal.SIGKILL)
        os.kill(os.getpid(), signal.SIGKILL)
