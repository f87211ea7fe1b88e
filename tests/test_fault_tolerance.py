"""[fault_tolerance] (torchft): replica groups that survive a dead peer, on real processes over loopback.

python -m torchmeg.replicas starts torchft's lighthouse and 2 replica groups x FSDP2 2 (world 4 in all);
the tests read each group's log (tee'd by the launcher) and metrics.jsonl. The groups are judged by
outside references: a plain HSDP 2 x 2 run (healthy), and one process replaying the committed history
from the logged membership (after a kill).
"""
import json
import os
import re
import signal
import subprocess
import sys
import time

import pytest
import torch

from conftest import TINY, read_metrics
from launch import ROOT, free_port, run_cli, run_one
from tolerance import assert_parity

pytest.importorskip("torchft")

ARGS = [a for a in TINY if not a.startswith(("--validation.", "--training.local_batch_size"))] + [
    "--validation.enable=false", "--training.local_batch_size=2", "--training.deterministic=true",
    "--checkpoint.enable=false", "--fault_tolerance.log_weights_hash=true"]
HSDP = ["--parallelism.data_parallel_replicate_degree=2", "--parallelism.data_parallel_shard_degree=2"]
TP2 = ["--parallelism.tensor_parallel_degree=2", "--parallelism.data_parallel_shard_degree=1"]


def replicas(tmp_path, args, env=None, timeout=150, extra=(), during=None):
    """python -m torchmeg.replicas (2 groups x 2 ranks) -> (exit code, [group 0's log, group 1's log], its
    output). `during(proc)`: called while it runs (a test that acts on a live job), then the wait."""
    cmd = [sys.executable, "-m", "torchmeg.replicas", "--groups=2", "--nproc_per_node=2", "--max_restarts=1",
           f"--lighthouse_port={free_port()}", "--heartbeat_timeout_ms=2000", "--join_timeout_ms=20000",
           f"--log_dir={tmp_path / 'logs'}", *extra, "--config", "recipes/debug_llama.toml",
           f"--job.dump_folder={tmp_path}", "--job.name=run", *args]
    e = dict(os.environ, PYTHONUNBUFFERED="1", **(env or {}))
    p = subprocess.Popen(cmd, cwd=ROOT, env=e, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                         start_new_session=True)
    try:
        if during is not None:
            during(p)
        out, _ = p.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(p.pid, 9)
        out, _ = p.communicate()
        raise AssertionError(f"python -m torchmeg.replicas did not finish in {timeout} s:\n{out[-4000:]}")
    finally:
        subprocess.run(["pkill", "-9", "-f", f"job.dump_folder={tmp_path}"], check=False)  # nothing left behind
    logs = [(tmp_path / "logs" / f"replica_{i}.log").read_text() for i in range(2)]
    return p.returncode, logs, out


def rows(tmp_path, group):
    return read_metrics(tmp_path / "run", f"replica_{group}")


def discarded_lines(log):
    """The discarded steps (a round: its last) with the LR and weights hash the group went back to."""
    return [dict(step=int(m[1] or m[0]), lr=float(m[2]), weights_hash=m[3]) for m in
            re.findall(r"steps?\s+(\d+)(?:-(\d+))? \| discarded .*? \| lr (\S+) \| weights_hash (\w+)", log)]


def test_recipe_errors_name_the_key():
    from torchmeg.config.errors import ConfigError
    from torchmeg.config.schema import load_config
    from torchmeg.config.checks import check_recipe
    on = ["--fault_tolerance.enable=true", "--fault_tolerance.group_size=2"]
    cases = {
        "fault_tolerance.replica_id = 2": ["--fault_tolerance.replica_id=2"],
        "fault_tolerance.min_replica_size = 3": ["--fault_tolerance.min_replica_size=3"],
        "fault_tolerance.outer_momentum = 1.5": ["--fault_tolerance.outer_momentum=1.5"],
        "training.objective = 'dpo'": ["--training.objective=dpo"],
        "parallelism.data_parallel_replicate_degree = 2": ["--parallelism.data_parallel_replicate_degree=2"],
        "checkpoint.folder = '/tmp/ck'": ["--checkpoint.folder=/tmp/ck"],
        "fault_tolerance.process_group_timeout_ms = 200000": ["--fault_tolerance.process_group_timeout_ms=200000"],
        "fault_tolerance.quorum_timeout_s = 2000": ["--fault_tolerance.quorum_timeout_s=2000"],
    }
    for want, extra in cases.items():
        with pytest.raises(ConfigError) as e:
            check_recipe(load_config("recipes/debug_llama.toml", on + extra))
        assert want in str(e.value) and "\n" not in str(e.value), str(e.value)
    cfg = load_config("recipes/debug_llama.toml", on + ["--fault_tolerance.replica_id=1"])
    check_recipe(cfg)  # a good one passes, and its outputs are the group's own
    assert cfg.run_dir.endswith(os.path.join("debug_llama", "replica_1"))


class _PeerManager:
    """torchft's Manager as average_across_groups sees it, with one peer group whose contribution is
    given: allreduce = the mean of this group's tensor and the peer's (the next tensor of `peer`)."""

    def __init__(self, peer):
        self.peer = torch.cat([t.reshape(-1) for t in peer])

    def allreduce(self, flat):
        flat.add_(self.peer).div_(2)
        return type("Work", (), {"wait": lambda self: None})()


def _inner_steps(model, opt, n, seed):
    g = torch.Generator().manual_seed(seed)
    for _ in range(n):
        for p in model.parameters():
            p.grad = torch.randn(p.shape, generator=g)
        opt.step()
        opt.zero_grad(set_to_none=True)


def _opt_state(opt):
    return [{k: v.clone() for k, v in opt.state[p].items()} for p in opt.param_groups[0]["params"]]


def test_a_round_steps_the_global_weights_with_the_outer_sgd_and_a_discarded_round_changes_nothing():
    """RoundState (torchmeg/train/semi_sync.py) on one process, the peer group's pseudo-gradients given:
    the new global weights are torch.optim.SGD's Nesterov step on the mean pseudo-gradient, bit for bit,
    its momentum carried across rounds; a rolled-back round leaves the weights and the inner AdamW's state
    exactly as they were when it began; LocalSGD's round averages the groups' weights."""
    from torchmeg.train.semi_sync import RoundState
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 3)
    inner = torch.optim.AdamW(model.parameters(), lr=0.1)
    rs = RoundState(model, inner, lr=0.7, momentum=0.9)
    ref = [p.detach().clone() for p in model.parameters()]  # the outer optimizer's reference, by hand
    ref_opt = torch.optim.SGD(ref, lr=0.7, momentum=0.9, nesterov=True)
    for rnd in range(3):
        rs.begin()
        start_w, start_state = [p.detach().clone() for p in model.parameters()], _opt_state(inner)
        _inner_steps(model, inner, 2, seed=rnd)
        assert not torch.equal(model.weight, start_w[0])  # the inner steps moved the weights
        peer = [torch.full_like(p, 0.01 * (rnd + 1)) for p in model.parameters()]
        rs.sync(_PeerManager(peer))
        if rnd == 1:  # discarded: as if the round never ran
            rs.rollback()
            assert all(torch.equal(p, w) for p, w in zip(model.parameters(), start_w))
            assert all(torch.equal(a[k], b[k]) for a, b in zip(_opt_state(inner), start_state) for k in a)
            continue
        for r, p, q in zip(ref, model.parameters(), peer):
            r.grad = ((r - p.detach()) + q) / 2
        ref_opt.step()
        rs.commit()
        assert all(torch.equal(p, r) for p, r in zip(model.parameters(), ref)), f"round {rnd}"
    assert torch.count_nonzero(ref_opt.state[ref[0]]["momentum_buffer"]) > 0
    assert all(torch.equal(m, ref_opt.state[r]["momentum_buffer"]) for m, r in zip(rs.momentum, ref))
    assert set(rs.state_dict()["momentum"]) == {"weight", "bias"}

    local_sgd = RoundState(model, inner, lr=1.0, momentum=0.0)
    local_sgd.begin()
    _inner_steps(model, inner, 2, seed=7)
    mine = [p.detach().clone() for p in model.parameters()]
    other = [w + 0.05 for w in mine]  # the peer's weights after its inner steps
    local_sgd.sync(_PeerManager([g - o for g, o in zip(local_sgd.global_, other)]))
    local_sgd.commit()
    for p, a, b in zip(model.parameters(), mine, other):
        # global - (global - mean) in fp32: within a couple of ulps of the weights' magnitude
        torch.testing.assert_close(p.detach(), (a + b) / 2, rtol=0, atol=4 * torch.finfo(torch.float32).eps)
    assert local_sgd.state_dict() == {"momentum": {}}


@pytest.mark.slow
def test_healthy_groups_train_as_hsdp_through_a_failed_allreduce_and_a_whole_restart(tmp_path):
    """8 steps, both groups every step, a checkpoint every 3. Step 5's cross-group all-reduce fails in
    both groups (injected): both discard it (weights hash and LR as after step 4) and retry it. After
    step 6, rank 0 of every group is killed: the whole job is down. Each group's agent restarts it; group
    0 resumes from its checkpoint of step 6 (the only group that writes), group 1 has none and is healed
    from group 0. Every committed step = a plain HSDP 2 x 2 run's."""
    env = {"TORCHMEG_TEST_FT_ERROR_AT_STEP": "5", "TORCHMEG_TEST_KILL_AT_STEP": "6", "TORCHMEG_TEST_KILL_RANK": "0"}
    code, logs, out = replicas(tmp_path, ARGS + ["--training.steps=8", "--checkpoint.enable=true",
                                                 "--checkpoint.interval=3", "--checkpoint.keep_latest_k=0"], env=env)
    assert code == 0, out[-4000:]
    assert [log.count("torchmeg 0.1.0 |") for log in logs] == [2, 2], "each group starts twice"
    assert "resumed   from step 6" in logs[0], logs[0][-3000:]
    assert re.search(r"healed\s+from replica group 0 at step 6:", logs[1]), logs[1][-3000:]
    written = [sorted(os.listdir(tmp_path / "run" / f"replica_{i}" / "checkpoint")) for i in range(2)]
    assert written[0] == ["step-00000003", "step-00000006", "step-00000008"] and written[1] == [], written
    g0, g1 = rows(tmp_path, 0), rows(tmp_path, 1)
    for g, log in zip((g0, g1), logs):
        assert [r["step"] for r in g] == list(range(1, 9)) and all(r["replicas"] == 2 for r in g)
        d = discarded_lines(log)
        assert [x["step"] for x in d] == [5], log[-3000:]
        step4 = next(r for r in g if r["step"] == 4)
        step5 = next(r for r in g if r["step"] == 5)
        assert d[0]["weights_hash"] == step4["weights_hash"]  # the discarded attempt changed no weight
        assert d[0]["lr"] == pytest.approx(step5["lr"], rel=1e-6)  # nor the schedule (the retry runs at step 5's LR)
        # (the count is this process's: the restarted groups start again from 0)
        assert [r["steps_discarded"] for r in g] == [0] * 4 + [1] * 2 + [0] * 2
    assert [r["weights_hash"] for r in g0] == [r["weights_hash"] for r in g1]  # the groups agree bit for bit
    ref = tmp_path / "hsdp"
    run_cli(ARGS + HSDP + ["--training.steps=8", "--fault_tolerance.log_weights_hash=false"], ref, nproc=4)
    assert_parity(read_metrics(ref), g0, keys=("loss", "grad_norm"))


@pytest.mark.slow
def test_a_killed_group_costs_the_survivor_a_step_and_heals_from_it(tmp_path):
    """SIGKILL rank 1 of group 1 as step 3's backward starts; checkpoints off, so a healed group's weights
    can only come from its peer. Group 0 never restarts and commits on; group 1 restarts, heals from
    group 0, and from then the two agree at every step; group 0's losses are those of one process
    replaying the committed history (the logged membership)."""
    # Group 0's steps alone last at least 1 s (TORCHMEG_TEST_FT_PACE_S): it is still training when group 1
    # is back, however loaded the machine (a restart took 6 s alone here, 17 s beside another test's
    # processes; the 77 steps after the kill give it 77 s).
    steps = 80
    code, logs, out = replicas(tmp_path, ARGS + [f"--training.steps={steps}"],
                               env={"TORCHMEG_TEST_FT_KILL": "1:1:3", "TORCHMEG_TEST_FT_PACE_S": "1.0"}, timeout=240)
    assert code == 0, out[-4000:]
    headers = [log.count("torchmeg 0.1.0 |") for log in logs]
    assert headers == [1, 2], f"starts per group {headers} (group 0 must never restart, group 1 once)"
    g0, g1 = rows(tmp_path, 0), rows(tmp_path, 1)
    assert [r["step"] for r in g0] == list(range(1, steps + 1))
    assert g0[-1]["steps_discarded"] <= 1
    assert any(r["replicas"] == 1 for r in g0), "group 0 never trained alone: the kill did not take group 1 out"
    heal = re.search(r"healed\s+from replica group 0 at step (\d+):", logs[1])
    assert heal, logs[1][-3000:]
    healed_at = int(heal[1])
    assert 3 <= healed_at < steps
    by_step = {r["step"]: r for r in g1 if r["step"] > healed_at}
    assert by_step, "group 1 logged no step after its heal"
    for r in g0:
        if r["step"] in by_step:
            assert r["weights_hash"] == by_step[r["step"]]["weights_hash"], f"groups differ at step {r['step']}"
            assert r["replicas"] == 2
    members = [r["replicas"] for r in g0]
    p = run_one([sys.executable, "tests/ft_replay_worker.py", json.dumps(members), "2", "--",
                 "--config", "recipes/debug_llama.toml", f"--job.dump_folder={tmp_path}", "--job.name=replay",
                 *ARGS, f"--training.steps={steps}", "--fault_tolerance.log_weights_hash=false"],
                dict(os.environ), timeout=120)
    assert p.returncode == 0, p.stderr[-3000:]
    replay = json.loads(p.stdout.strip().splitlines()[-1])
    got = [{k: r[k] for k in ("step", "loss", "grad_norm")} for r in g0]
    # The parity rule (tests/tolerance.py) bounds the drift of two reduction orders over <= 20 steps: the
    # loss and grad norm are held to it there (the kill, the discarded step and 17 steps alone), and the
    # loss at every step (measured: <= 1e-6 relative over 150 steps; the grad norm, a sum of squares of
    # small differences, drifted to ~1e-4 by step 150, so it is compared where the rule holds).
    assert_parity(replay, got, keys=("loss", "grad_norm"), steps=range(1, 21))
    assert_parity(replay, got, keys=("loss",))


@pytest.mark.slow
def test_a_hung_group_costs_the_survivor_the_group_timeout_not_a_watchdog_exit(tmp_path):
    """SIGSTOP rank 0 of group 1 in step 3's backward (a hung peer: alive, silent). Group 0's cross-group
    all-reduce gives up after fault_tolerance.process_group_timeout_ms (3 s, under the watchdog's 8 s
    floor), it discards that step and goes on alone; no watchdog fires anywhere. SIGCONT brings group 1
    back: it discards its stale step, is healed from group 0, and the two agree from then on."""
    steps = 60  # (group 0's steps alone last 0.5 s: group 1 is back within the 57 after the hang)
    logs_dir = tmp_path / "logs"

    def hang_then_resume(proc):
        deadline = time.time() + 120
        pid = None
        while time.time() < deadline and proc.poll() is None:
            text = (logs_dir / "replica_1.log").read_text() if (logs_dir / "replica_1.log").exists() else ""
            m = re.search(r"\(pid (\d+)\): SIGSTOP", text)
            pid = pid or (int(m[1]) if m else None)
            g0 = (tmp_path / "run" / "replica_0" / "metrics.jsonl")
            alone = [json.loads(x) for x in g0.read_text().splitlines()] if g0.exists() else []
            if pid and sum(r["replicas"] == 1 for r in alone) >= 5:
                os.kill(pid, signal.SIGCONT)
                return
            time.sleep(0.2)
        raise AssertionError(f"group 1 never stopped or group 0 never went on alone (pid {pid})")

    code, logs, out = replicas(tmp_path, ARGS + [f"--training.steps={steps}", "--training.watchdog_min_s=8",
                                                 "--fault_tolerance.process_group_timeout_ms=3000"],
                               env={"TORCHMEG_TEST_FT_STOP": "1:0:3", "TORCHMEG_TEST_FT_PACE_S": "0.5"},
                               timeout=240, during=hang_then_resume)
    assert code == 0, out[-4000:]
    assert "watchdog" not in out, out[-4000:]
    assert [log.count("torchmeg 0.1.0 |") for log in logs] == [1, 1], "a group restarted: the hang was not survived"
    g0, g1 = rows(tmp_path, 0), rows(tmp_path, 1)
    assert [r["step"] for r in g0] == list(range(1, steps + 1))
    assert [x["step"] for x in discarded_lines(logs[0])] == [3], logs[0][-3000:]
    assert sum(r["replicas"] == 1 for r in g0) >= 5
    heal = re.search(r"healed\s+from replica group 0 at step (\d+):", logs[1])
    assert heal, logs[1][-3000:]
    after = {r["step"]: r for r in g1 if r["step"] > int(heal[1])}
    assert after and all(r["weights_hash"] == after[r["step"]]["weights_hash"] for r in g0 if r["step"] in after)


@pytest.mark.slow
def test_the_slurm_script_runs_one_group_per_node(tmp_path):
    """tools/slurm/replicas.sbatch as Slurm would run it on two nodes (stand-ins for `scontrol`: two
    loopback hosts, and `srun`: its command once per node with SLURM_NODEID): the lighthouse, then two
    replica groups of 2 ranks that train every step together. Each group is TP 2 here (the other tests'
    are FSDP2): the steps equal a plain run of data parallel 2 x TP 2."""
    bin_ = tmp_path / "bin"
    bin_.mkdir()
    (bin_ / "scontrol").write_text("#!/bin/bash\nprintf '127.0.0.1\\n127.0.0.1\\n'\n")
    (bin_ / "srun").write_text("#!/bin/bash\nshift  # --kill-on-bad-exit\n"
                               "for n in 0 1; do SLURM_NODEID=$n \"$@\" & pids+=($!); done\n"
                               "rc=0; for p in ${pids[@]}; do wait $p || rc=1; done; exit $rc\n")
    for f in ("scontrol", "srun"):
        os.chmod(bin_ / f, 0o755)
    port = free_port()
    env = dict(os.environ, PATH=f"{bin_}:{os.environ['PATH']}", SLURM_JOB_NODELIST="fake[1-2]", SLURM_JOB_NUM_NODES="2",
               SLURM_JOB_ID=str(port), TORCHMEG_RDZV_PORT=str(port), TORCHMEG_LIGHTHOUSE_PORT=str(free_port()),
               TORCHMEG_NPROC_PER_NODE="2", PYTHONUNBUFFERED="1", PYTHON=sys.executable)
    p = subprocess.run(["bash", "tools/slurm/replicas.sbatch", "recipes/debug_llama.toml", f"--job.dump_folder={tmp_path}",
                        "--job.name=run", *ARGS, *TP2, "--training.steps=4"], cwd=ROOT, env=env,
                       capture_output=True, text=True, timeout=150)
    assert p.returncode == 0, p.stderr[-3000:]
    g0, g1 = rows(tmp_path, 0), rows(tmp_path, 1)
    assert [r["step"] for r in g0] == [r["step"] for r in g1] == [1, 2, 3, 4]
    assert all(r["replicas"] == 2 for r in g0 + g1)
    assert [r["weights_hash"] for r in g0] == [r["weights_hash"] for r in g1]
    ref = tmp_path / "dp2_tp2"
    run_cli(ARGS + TP2 + ["--parallelism.data_parallel_replicate_degree=2", "--training.steps=4",
                          "--fault_tolerance.log_weights_hash=false"], ref, nproc=4)
    assert_parity(read_metrics(ref), g0, keys=("loss", "grad_norm"))


DILOCO = ["--fault_tolerance.semi_sync_method=diloco", "--fault_tolerance.sync_steps=4"]


@pytest.mark.slow
def test_diloco_rounds_survive_a_failed_sync_and_a_whole_restart_bit_for_bit(tmp_path):
    """DiLoCo, a sync every 4 steps, 12 steps, a checkpoint at 8. Step 8's sync fails in both groups
    (injected): both discard the round 5-8 (weights and LR back to step 4's) and retry it. After step 8
    rank 0 of every group is killed; group 0 resumes from its checkpoint (weights, the outer momentum),
    group 1 is healed from group 0 (the same, from the peer). Every step of both groups equals an
    uninterrupted DiLoCo run's bit for bit (weights hash): the outer step at 12 uses the momentum of the
    syncs at 4 and 8, so a momentum lost on either path would show. The inner optimizer is plain SGD here,
    which has no state: a healed group takes its peer's inner state (its own died with it), so under AdamW
    group 1's steps after the heal would differ from the uninterrupted run's by design (the discarded
    round's rollback of AdamW's moments is checked bit for bit above). Between syncs the groups' weights
    differ (each trains its own batches); at every sync they are equal."""
    args = ARGS + DILOCO + ["--training.steps=12", "--optimizer.name=sgd", "--optimizer.lr=0.5",
                            "--optimizer.betas=[0.0,0.95]"]
    ref_code, _, ref_out = replicas(tmp_path / "ref", args)
    assert ref_code == 0, ref_out[-4000:]
    env = {"TORCHMEG_TEST_FT_ERROR_AT_STEP": "8", "TORCHMEG_TEST_KILL_AT_STEP": "8", "TORCHMEG_TEST_KILL_RANK": "0"}
    code, logs, out = replicas(tmp_path, args + ["--checkpoint.enable=true", "--checkpoint.interval=8",
                                                 "--checkpoint.keep_latest_k=0"], env=env)
    assert code == 0, out[-4000:]
    assert [log.count("torchmeg 0.1.0 |") for log in logs] == [2, 2], "each group starts twice"
    assert "resumed   from step 8" in logs[0], logs[0][-3000:]
    assert re.search(r"healed\s+from replica group 0 at step 8:", logs[1]), logs[1][-3000:]
    g0, g1 = rows(tmp_path, 0), rows(tmp_path, 1)
    for i, (g, log) in enumerate(zip((g0, g1), logs)):
        assert [r["step"] for r in g] == list(range(1, 13)) and all(r["replicas"] == 2 for r in g)
        d = discarded_lines(log)
        assert [x["step"] for x in d] == [8] and "steps 5-8 | discarded" in log, log[-3000:]
        assert d[0]["weights_hash"] == g[3]["weights_hash"]  # the round gave back every weight
        assert d[0]["lr"] == pytest.approx(g[4]["lr"], rel=1e-6)  # and the schedule
        ref = rows(tmp_path / "ref", i)
        assert [r["weights_hash"] for r in g] == [r["weights_hash"] for r in ref], f"group {i} differs from the reference"
        assert [r["step"] for r in g if "sync_s" in r] == [4, 8, 12]
    same = [a["weights_hash"] == b["weights_hash"] for a, b in zip(g0, g1)]
    assert same == [s % 4 == 0 for s in range(1, 13)], same


@pytest.mark.slow
def test_diloco_survives_a_kill_mid_round_and_converges_like_synchronous_training(tmp_path):
    """DiLoCo, a sync every 4 steps, 50 steps on the debug recipe's tiny model. Rank 1 of group 1 is
    SIGKILLed at inner step 2 of the round 13-16. Group 0 finds out at the round's sync, discards that one
    round (4 steps), goes on alone and never restarts; group 1 comes back, is healed from group 0 at a
    round's start, and from the next sync on the two groups' global weights are equal at every sync. The
    held-out loss of the final global weights is compared with a plain synchronous HSDP 2 x 2 run of the
    same 50 steps (the same 32 held-out sequences)."""
    # Group 0's steps alone last >= 2 s: a restart of up to ~60 s (17 s seen beside other tests) still
    # ends before the run does.
    val = ["--validation.enable=true", "--validation.freq=50"]
    code, logs, out = replicas(tmp_path, ARGS + DILOCO + val + ["--training.steps=50", "--validation.steps=8"],
                               env={"TORCHMEG_TEST_FT_KILL": "1:1:14", "TORCHMEG_TEST_FT_PACE_S": "2.0"}, timeout=240)
    assert code == 0, out[-4000:]
    assert [log.count("torchmeg 0.1.0 |") for log in logs] == [1, 2], "group 0 must never restart, group 1 once"
    g0, g1 = rows(tmp_path, 0), rows(tmp_path, 1)
    assert [r["step"] for r in g0] == list(range(1, 51))
    assert [x["step"] for x in discarded_lines(logs[0])] == [16] and g0[-1]["steps_discarded"] == 4, logs[0][-3000:]
    assert any(r["replicas"] == 1 for r in g0), "group 0 never trained alone: the kill did not take group 1 out"
    heal = re.search(r"healed\s+from replica group 0 at step (\d+):", logs[1])
    assert heal and int(heal[1]) % 4 == 0 and 16 <= int(heal[1]) < 48, logs[1][-3000:]
    syncs = {r["step"]: r for r in g1 if r["step"] > int(heal[1]) and "sync_s" in r}
    assert syncs and all(r["weights_hash"] == syncs[r["step"]]["weights_hash"] for r in g0 if r["step"] in syncs)
    assert g0[-1]["val_loss"] == g1[-1]["val_loss"]  # the same global weights
    ref = tmp_path / "hsdp"
    run_cli(ARGS + HSDP + val + ["--training.steps=50", "--validation.steps=4",
                                 "--fault_tolerance.log_weights_hash=false"], ref, nproc=4)
    sync_val = read_metrics(ref)[-1]["val_loss"]
    # The stated margin: DiLoCo's defaults (outer lr 0.7, Nesterov 0.9) over 12 outer steps held out 2.71
    # healthy and 2.78 with this kill against the synchronous run's 2.46 (+10%, +13%; LocalSGD: 2.50,
    # +2%); 15%. A round that did not average, or an outer step of the wrong sign, is far outside it.
    assert g0[-1]["val_loss"] <= 1.15 * sync_val, (g0[-1]["val_loss"], sync_val)
