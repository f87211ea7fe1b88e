"""Beyond one machine, on loopback: two torchrun agents (2 nodes x 2 ranks) meeting through a c10d
rendezvous, as two hosts would (python -m torchmeg.launch = torchrun + one-line failures).

Each agent gets its own data cache directory, as each host has its own disk, so "once per node"
can be seen in the log.
"""
import os
import shutil
import signal
import subprocess
import sys
import time

import pytest

from conftest import TINY, assert_parity, read_metrics
from launch import ROOT, free_port, run_cli

ARGS = TINY + ["--training.steps=20", "--training.deterministic=true", "--training.global_batch_size=8",
               "--checkpoint.enable=true", "--checkpoint.interval=5", "--checkpoint.keep_latest_k=0"]
HSDP = ["--training.local_batch_size=2", "--parallelism.data_parallel_replicate_degree=2",
        "--parallelism.data_parallel_shard_degree=2"]


def _port() -> int:
    return free_port()


def _agent(node: int, out, port: int, extra=(), env=None, nnodes=2, rdzv_conf=None) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "torchmeg.launch", f"--nnodes={nnodes}", "--nproc_per_node=2",
           "--rdzv-backend=c10d", f"--rdzv-endpoint=127.0.0.1:{port}", f"--rdzv-id=job{port}", "--max-restarts=1"]
    cmd += [f"--rdzv-conf={rdzv_conf}"] if rdzv_conf else []
    cmd += ["-m", "torchmeg.train", f"--job.dump_folder={out}", "--job.name=run"] + ARGS + HSDP + list(extra)
    e = dict(os.environ, PYTHONUNBUFFERED="1", TORCHMEG_CACHE=str(out / f"cache{node}"),
             **(env or {}))
    log = open(out / f"agent{node}.log", "a")
    p = subprocess.Popen(cmd, cwd=ROOT, env=e, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    if node == 0:
        # Both agents are on this host, so either may bind the rendezvous endpoint and host the
        # c10d store; node 0 must (as on a cluster, where the endpoint is node 0's): a store hosted
        # by a node the test kills takes the rendezvous down with it.
        _wait_listening(port, p)
    return p


def _wait_listening(port: int, proc: subprocess.Popen, timeout: float = 60.0) -> None:
    """Until something listens on `port` (read from /proc/net/tcp*: no connection is made)."""
    deadline = time.time() + timeout
    while time.time() < deadline and proc.poll() is None:
        for table in ("/proc/net/tcp", "/proc/net/tcp6"):
            with open(table) as fh:
                for line in fh.readlines()[1:]:
                    local, state = line.split()[1], line.split()[3]
                    if state == "0A" and int(local.rsplit(":", 1)[1], 16) == port:  # 0A: LISTEN
                        return
        time.sleep(0.05)
    raise AssertionError(f"agent 0 did not open the rendezvous port {port} within {timeout} s")


def _wait(procs, timeout: float) -> list[int]:
    deadline = time.time() + timeout
    for p in procs:
        try:
            p.wait(max(1.0, deadline - time.time()))
        except subprocess.TimeoutExpired:
            for q in procs:
                try:
                    os.killpg(q.pid, signal.SIGKILL)
                except ProcessLookupError:  # (that one had already exited)
                    pass
            raise AssertionError(f"agents still running after {timeout} s")
    return [p.returncode for p in procs]


def _log(out, node) -> str:
    return (out / f"agent{node}.log").read_text()


def _logs(out) -> str:
    """Both agents' logs. torchrun's c10d rendezvous numbers the nodes of each round by (host, agent
    pid), so which agent hosts global rank 0 (the header, "resumed from") is its choice: pids wrap
    (pid_max is 32,768 here), and a replacement agent started later can take node 0 (seen once in a
    .ci/run: the resume line was in agent 1's log)."""
    return _log(out, 0) + _log(out, 1)


@pytest.fixture(scope="module")
def two_nodes(tmp_path_factory):
    """The uninterrupted two-node HSDP run (replicate across the nodes, shard inside each)."""
    out = tmp_path_factory.mktemp("two_nodes")
    port = _port()
    codes = _wait([_agent(0, out, port), _agent(1, out, port)], 150)
    assert codes == [0, 0], _log(out, 0)[-3000:] + _log(out, 1)[-3000:]
    return out


@pytest.mark.slow
def test_two_nodes_train_hsdp_like_one_process_and_prepare_data_once_per_node(two_nodes, tmp_path):
    ref = tmp_path / "ref"
    run_cli(ARGS + ["--training.local_batch_size=8"], ref)
    assert_parity(read_metrics(ref), read_metrics(two_nodes))  # the parity rule, as every layout on one machine
    assert "nodes      2 x 2 ranks: within a node: dp_shard 2; across nodes: dp_replicate 2" in _logs(two_nodes)
    # each node's local rank 0 built its node's cache (the agent's own folder), once; nobody else did.
    # (The node numbers are the rendezvous's: _logs.)
    numbers = set()
    for agent in (0, 1):
        lines = [x for x in _log(two_nodes, agent).splitlines() if x.startswith("[data] node")]
        assert len(lines) == 1 and f"cache{agent}" in lines[0] and " built in " in lines[0], lines
        numbers.add(lines[0].split()[2])
    assert numbers == {"0", "1"}, numbers
    # the two-node run's step-10 checkpoint resumes on one agent x 4 ranks and retrains steps 11-20
    # as the two nodes did (the same layout: the same numbers)
    folder = tmp_path / "ckpt"
    shutil.copytree(two_nodes / "run" / "checkpoint", folder)
    p = run_cli(ARGS + HSDP + [f"--checkpoint.folder={folder}", "--checkpoint.load_step=10"], tmp_path, nproc=4,
                name="one_agent", torchrun=True, timeout=150)
    assert "resumed   from step 10" in p.stdout
    assert_parity(read_metrics(two_nodes)[10:], read_metrics(tmp_path, "one_agent"))


@pytest.mark.slow
def test_a_lost_node_rejoins_and_the_run_resumes_bit_identically(two_nodes, tmp_path):
    """Node 1 (its agent and both workers) dies after step 12; the surviving agent restarts its
    workers and waits in a new rendezvous round; a replacement node 1 (a new agent, as a scheduler
    would start) joins; both resume from the step-10 checkpoint and finish with the losses of the
    uninterrupted run, bit for bit."""
    port = _port()
    # the agent that dies is named by its own environment, not by the node number the rendezvous gives
    # it (by agent pid: _logs); agent 0 hosts the rendezvous store and must live
    a = _agent(0, tmp_path, port)
    b = _agent(1, tmp_path, port, env={"TORCHMEG_TEST_KILL_NODE_AT_STEP": "12", "TORCHMEG_TEST_KILL_NODE": "any"})
    assert _wait([b], 120) == [-signal.SIGKILL], _log(tmp_path, 1)[-3000:]  # the node is gone
    b2 = _agent(1, tmp_path, port)  # its replacement
    assert _wait([a, b2], 150) == [0, 0], _log(tmp_path, 0)[-3000:] + _log(tmp_path, 1)[-3000:]
    assert "resumed   from step 10" in _logs(tmp_path)  # (agent 1's log: the replacement's, after the lost one's)
    got, want = read_metrics(tmp_path), read_metrics(two_nodes)
    assert [r["step"] for r in got] == list(range(1, 21))
    for g, w in zip(got, want):
        assert (g["loss"], g["grad_norm"]) == (w["loss"], w["grad_norm"]), (g, w)


@pytest.mark.slow
def test_a_node_that_never_joins_ends_the_rendezvous_in_one_line(tmp_path):
    t0 = time.time()
    a = _agent(0, tmp_path, _port(), rdzv_conf="join_timeout=5")  # (5 s of waiting: what the test costs)
    assert _wait([a], 90) == [2]
    assert time.time() - t0 < 60
    last = _log(tmp_path, 0).strip().splitlines()[-1]
    assert last.startswith("torchmeg.launch: error: rendezvous") and "--nnodes=2" in last \
        and "join_timeout" in last, last


@pytest.mark.slow
def test_the_slurm_script_launches_two_nodes(tmp_path):
    """tools/slurm/train.sbatch as Slurm would run it on two nodes, with stand-ins for `scontrol`
    (the node list: two loopback hosts) and `srun` (its command once per node, in parallel): it
    trains to the end, both nodes in one rendezvous."""
    bin_ = tmp_path / "bin"
    bin_.mkdir()
    (bin_ / "scontrol").write_text("#!/bin/bash\nprintf '127.0.0.1\\n127.0.0.1\\n'\n")
    (bin_ / "srun").write_text("#!/bin/bash\nshift  # --kill-on-bad-exit\n"
                               "for n in 0 1; do TORCHMEG_CACHE=$TMP_CACHE/$n \"$@\" & done\nwait\n")
    for f in ("scontrol", "srun"):
        os.chmod(bin_ / f, 0o755)
    env = dict(os.environ, PATH=f"{bin_}:{os.environ['PATH']}", SLURM_JOB_NODELIST="fake[1-2]", SLURM_JOB_NUM_NODES="2",
               SLURM_JOB_ID=str(_port()), TORCHMEG_RDZV_PORT=str(_port()), TORCHMEG_NPROC_PER_NODE="2",
               TMP_CACHE=str(tmp_path / "cache"), PYTHONUNBUFFERED="1", PYTHON=sys.executable)  # this interpreter, not PATH's
    p = subprocess.run(["bash", "tools/slurm/train.sbatch", "recipes/debug_llama.toml", f"--job.dump_folder={tmp_path}",
                        "--job.name=slurm"] + TINY + ["--training.steps=4", "--training.global_batch_size=16"],
                       cwd=ROOT, env=env, capture_output=True, text=True, timeout=150)
    assert p.returncode == 0, p.stderr[-3000:]
    assert "nodes      2 x 2 ranks" in p.stdout and [r["step"] for r in read_metrics(tmp_path, "slurm")] == [1, 2, 3, 4]


def test_ports_for_servers_bound_later_are_drawn_below_the_ephemeral_range():
    """torchmeg/runtime/ports.py: a port that another process binds seconds later (the workers' store,
    a rendezvous, the lighthouse) is drawn below the kernel's ephemeral range, where no outgoing
    connection can take it in the meantime, and is free when drawn; torchmeg.launch hands the draw to
    torch's rendezvous, which otherwise picks MASTER_PORT by binding port 0 (an ephemeral port: a
    replica group's rank 0 once failed to start there with EADDRINUSE under the suite's load)."""
    import socket
    from torch.distributed.elastic.rendezvous import api
    from torchmeg.runtime import launch
    from torchmeg.runtime.ports import RANGE, ephemeral_start, unused_port
    ports = [unused_port() for _ in range(20)]
    assert all(RANGE[0] <= p < min(RANGE[1], ephemeral_start()) for p in ports) and len(set(ports)) > 1, ports
    with socket.socket() as s:
        s.bind(("", ports[0]))  # free as drawn
    saved = api.get_free_port
    try:
        with pytest.raises(SystemExit):
            launch.main(["--help"])
        assert api.get_free_port is unused_port
    finally:
        api.get_free_port = saved
