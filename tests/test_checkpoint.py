"""Checkpoints: exact resume, resharding, crash recovery, atomic commits, non-finite guards, HF export."""
import json
import os
import signal
import subprocess
import sys
import time

import pytest
import torch

from conftest import FP32_PARITY, TINY, assert_close, assert_tensor_close, read_metrics, rel_diff
from launch import ROOT, free_port, run_cli

P = "--parallelism."
BASE = TINY + ["--training.steps=20", "--training.deterministic=true", "--training.global_batch_size=4",
               "--checkpoint.interval=5"]
CK = ["--checkpoint.enable=true"]


def by_step(rows):
    """Last row per step (a resumed run logs the steps after its checkpoint again)."""
    return {r["step"]: r for r in rows}


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    d = tmp_path_factory.mktemp("full")
    run_cli(BASE + ["--training.local_batch_size=4"], d)
    return by_step(read_metrics(d))


def same(ref, got, rtol=0.0, steps=range(1, 21)):
    """rtol 0: bit for bit (the same layout resumed); else relative, as every parity (conftest)."""
    for s in steps:
        for k in ("loss", "grad_norm"):
            if rtol == 0.0:
                assert ref[s][k] == got[s][k], f"step {s} {k}: {ref[s][k]!r} vs {got[s][k]!r}"
            else:
                assert_close(ref[s][k], got[s][k], rtol, f"step {s} {k}")


@pytest.mark.slow
@pytest.mark.parametrize("name, ranks, local, layout, extra", [
    ("single", 1, 4, [], []),
    ("fsdp2", 2, 2, [P + "data_parallel_shard_degree=2"], []),
    ("fsdp2_async", 2, 2, [P + "data_parallel_shard_degree=2"], ["--checkpoint.async_mode=async"]),
])
def test_exact_resume(name, ranks, local, layout, extra, tmp_path, uninterrupted):
    """SIGKILL after step 10 (a save step), or, async, after step 8: the step-5 save's background write
    finished (the kill hook waits for it, so the test does not race the disk) and the next interval is
    still 2 steps away. An async save is committed at the first step after its write finished, so the
    restart resumes from step 5; committed only at the next save (as before), it was lost."""
    args = BASE + CK + [f"--training.local_batch_size={local}"] + layout + extra
    kill = 8 if "async" in name else 10
    p = run_cli(args, tmp_path, nproc=ranks, env={"TORCHMEG_TEST_KILL_AT_STEP": str(kill)}, check=False)
    assert p.returncode != 0 and len(read_metrics(tmp_path)) == kill
    if "async" in name:
        assert "[checkpoint] step 5 committed" in p.stdout, p.stdout[-2000:]
    p = run_cli(args, tmp_path, nproc=ranks)
    resumed = 5 if "async" in name else 10
    assert f"resumed   from step {resumed}" in p.stdout
    rows = read_metrics(tmp_path)
    # The rows the killed run logged after its checkpoint are replaced, not repeated.
    assert [r["step"] for r in rows] == list(range(1, 21))
    if ranks == 1:
        same(uninterrupted, by_step(rows))  # bit for bit
    else:
        ref = tmp_path / "ref"
        run_cli(BASE + [f"--training.local_batch_size={local}"] + layout, ref, nproc=ranks)
        same(by_step(read_metrics(ref)), by_step(rows))  # bit for bit against the same layout


@pytest.mark.slow
def test_reshard_fsdp2_to_tp2_and_single(tmp_path, uninterrupted):
    fsdp = BASE + CK + ["--training.local_batch_size=2", P + "data_parallel_shard_degree=2"]
    run_cli(fsdp, tmp_path, nproc=2, env={"TORCHMEG_TEST_KILL_AT_STEP": "10"}, check=False)
    folder = tmp_path / "run" / "checkpoint"
    assert sorted(os.listdir(folder)) == ["step-00000005", "step-00000010"]
    for name, ranks, layout in (("tp2", 2, [P + "tensor_parallel_degree=2", P + "data_parallel_shard_degree=1"]),
                                ("one", 1, [])):
        ck = f"--checkpoint.folder={folder}"
        p = run_cli(BASE + CK + [ck, "--training.local_batch_size=4", "--checkpoint.interval=100",
                                 "--checkpoint.keep_latest_k=0"] + layout, tmp_path, nproc=ranks, name=name)
        assert "resumed   from step 10" in p.stdout
        got = by_step(read_metrics(tmp_path, name))
        assert sorted(got) == list(range(11, 21))
        same(uninterrupted, got, rtol=FP32_PARITY, steps=range(11, 21))
        # leave step 10 as the latest for the next layout
        import shutil
        shutil.rmtree(folder / "step-00000020")


@pytest.mark.slow
def test_sigkill_rank_restarts_and_resumes(tmp_path, uninterrupted):
    args = BASE + CK + ["--training.local_batch_size=2", P + "data_parallel_shard_degree=2"]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", "--max-restarts=1",
           "-m", "torchmeg.train", f"--job.dump_folder={tmp_path}", "--job.name=run"] + args
    env = dict(os.environ, TORCHMEG_TEST_KILL_AT_STEP="12", TORCHMEG_TEST_KILL_RANK="1")
    p = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=180)
    assert p.returncode == 0, p.stderr[-3000:]
    assert "resumed   from step 10" in p.stdout
    rows = read_metrics(tmp_path)
    assert [r["step"] for r in rows][-10:] == list(range(11, 21))
    ref = tmp_path / "ref"
    run_cli(BASE + ["--training.local_batch_size=2", P + "data_parallel_shard_degree=2"], ref, nproc=2)
    same(by_step(read_metrics(ref)), by_step(rows))


@pytest.mark.slow
@pytest.mark.parametrize("damage", ["none", "no_metadata", "short_file"])
def test_save_killed_before_commit(tmp_path, uninterrupted, damage):
    """Killed after step 10's files were written, before its commit: the restart commits that save
    and resumes from step 10 (nothing written is lost). The same save cut off mid-write (DCP's
    .metadata, written last, missing; or a data file short of what it records) is removed and the run
    resumes from step 5. Either way the rest of the run equals the uninterrupted one bit for bit."""
    args = BASE + CK + ["--training.local_batch_size=4"]
    p = run_cli(args, tmp_path, env={"TORCHMEG_TEST_KILL_IN_SAVE": "10"}, check=False)
    assert p.returncode == 17
    folder = tmp_path / "run" / "checkpoint"
    assert sorted(os.listdir(folder)) == [".tmp-step-00000010", "step-00000005"]
    tmp = folder / ".tmp-step-00000010"
    if damage == "no_metadata":
        os.remove(tmp / ".metadata")
    elif damage == "short_file":
        data = max((f for f in os.listdir(tmp) if f.endswith(".distcp")), key=lambda f: os.path.getsize(tmp / f))
        with open(tmp / data, "r+b") as fh:
            fh.truncate(os.path.getsize(tmp / data) // 2)
    p = run_cli(args, tmp_path)
    resumed = 10 if damage == "none" else 5
    assert f"resumed   from step {resumed}" in p.stdout, p.stdout[-2000:]
    assert ("committed now" in p.stdout) == (damage == "none") and ("interrupted save" in p.stdout) != (damage == "none")
    assert not any(n.startswith(".tmp") for n in os.listdir(folder))
    same(uninterrupted, by_step(read_metrics(tmp_path)))


@pytest.mark.slow
@pytest.mark.parametrize("point", ["marker", "aside", "renamed"])
def test_killed_between_any_two_commit_steps(tmp_path, uninterrupted, point):
    """A kill between any two steps of a commit (checkpoint.folder.commit_folder: the marker written
    into the save, a folder already at the step set aside, the rename, the marker-to-be dropped)
    leaves the new save whole: the restart resumes from it, leaves nothing behind, and the rest of
    the run equals the uninterrupted one bit for bit. 'aside' needs a folder already at that step:
    the run is re-trained from step 5 over its own step 10."""
    args = BASE + CK + ["--training.local_batch_size=4", "--checkpoint.keep_latest_k=0"]
    killed = 5
    if point == "aside":  # steps 5 and 10 committed (killed at 12), then re-trained from 5
        p = run_cli(args, tmp_path, env={"TORCHMEG_TEST_KILL_AT_STEP": "12"}, check=False)
        assert p.returncode != 0 and (tmp_path / "run" / "checkpoint" / "step-00000010").is_dir()
        args_kill, killed = args + ["--checkpoint.load_step=5"], 10
    else:
        args_kill = args
    p = run_cli(args_kill, tmp_path, env={"TORCHMEG_TEST_KILL_IN_COMMIT": point}, check=False)
    assert p.returncode == 17, p.stderr[-2000:]
    folder = tmp_path / "run" / "checkpoint"
    p = run_cli(args, tmp_path)
    assert f"resumed   from step {killed}" in p.stdout, (point, p.stdout[-2000:])
    assert sorted(os.listdir(folder)) == [f"step-{s:08d}" for s in (5, 10, 15, 20)], os.listdir(folder)
    assert not any((folder / n / "torchmeg.pending.json").exists() for n in os.listdir(folder))
    same(uninterrupted, by_step(read_metrics(tmp_path)))


@pytest.mark.slow
def test_keep_latest_k_prunes_after_commit(tmp_path):
    run_cli(BASE + CK + ["--training.local_batch_size=4", "--checkpoint.keep_latest_k=2"], tmp_path)
    assert sorted(os.listdir(tmp_path / "run" / "checkpoint")) == ["step-00000015", "step-00000020"]


def _finite_checkpoint(path):
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import FileSystemReader
    meta = FileSystemReader(str(path)).read_metadata()
    sd = {k: torch.empty(v.size, dtype=v.properties.dtype) for k, v in meta.state_dict_metadata.items()
          if k.startswith("model.") and hasattr(v, "size")}
    dcp.load(sd, checkpoint_id=str(path), no_dist=True)
    return all(torch.isfinite(t).all() for t in sd.values()) and len(sd) > 0


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["skip", "stop"])
def test_nan_injection(mode, tmp_path):
    args = BASE + CK + ["--training.local_batch_size=4", f"--training.on_nonfinite={mode}"]
    p = run_cli(args, tmp_path, env={"TORCHMEG_TEST_NAN_AT_STEP": "7"}, check=False)
    rows = by_step(read_metrics(tmp_path))
    folder = tmp_path / "run" / "checkpoint"
    if mode == "skip":
        assert p.returncode == 0 and rows[7].get("skipped") and not rows[8].get("skipped")
        assert rows[20]["loss"] == rows[20]["loss"]  # finite afterwards
    else:
        assert p.returncode == 1 and "non-finite" in p.stderr and max(rows) == 6
        assert sorted(os.listdir(folder)) == ["step-00000005"]
    for name in os.listdir(folder):
        assert _finite_checkpoint(folder / name), name


@pytest.mark.slow
def test_sigterm_saves_and_exits_zero(tmp_path):
    args = BASE[:] + CK + ["--training.local_batch_size=4", "--training.steps=100000", "--checkpoint.interval=100000"]
    cmd = [sys.executable, "-m", "torchmeg.train", f"--job.dump_folder={tmp_path}", "--job.name=run"] + args
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    metrics = tmp_path / "run" / "metrics.jsonl"
    deadline = time.time() + 60
    while time.time() < deadline and (not metrics.exists() or len(metrics.read_text().splitlines()) < 3):
        time.sleep(0.2)
    proc.send_signal(signal.SIGTERM)
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 0, err[-2000:]
    last = read_metrics(tmp_path)[-1]["step"]
    assert "SIGTERM: stopped after step" in out
    assert os.listdir(tmp_path / "run" / "checkpoint") == [f"step-{last:08d}"]


@pytest.mark.slow
def test_unwritable_checkpoint_folder_fails_first(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("not a folder")
    p = run_cli(TINY + CK + [f"--checkpoint.folder={blocker}/ck"], tmp_path, check=False)
    assert p.returncode == 2 and "checkpoint.folder" in p.stderr and len(p.stderr.strip().splitlines()) == 1
    assert "step" not in p.stdout


def _tiny_llama(**over):
    from torchmeg.config.schema import load_config
    from torchmeg.models import build_model, init_weights
    args = [a for a in TINY if a.startswith("--model.")] + [f"--model.{k}={v}" for k, v in over.items()]
    cfg = load_config(None, args)
    m = build_model(cfg, 257, "cpu")
    init_weights(m, seed=1)
    return m


@pytest.mark.parametrize("tied", [False, True])
def test_hf_export_and_import_logits(tmp_path, tied):
    from transformers import LlamaForCausalLM
    from torchmeg.checkpoint.hf_files import load_hf, save_hf
    m = _tiny_llama(tie_embeddings=tied).eval()
    save_hf(m.state_dict(), m.args, str(tmp_path / "hf"))
    hf = LlamaForCausalLM.from_pretrained(str(tmp_path / "hf")).eval()
    x = torch.randint(0, 257, (2, 24), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert_tensor_close(hf(x).logits, m(x), FP32_PARITY, "exported logits")
        for p in hf.parameters():  # an HF model with other weights, imported back
            p.add_(torch.randn_like(p) * 0.01)
    hf.save_pretrained(str(tmp_path / "hf2"))
    m2 = _tiny_llama(tie_embeddings=tied).eval()
    m2.load_state_dict(load_hf(str(tmp_path / "hf2"), m2.args))
    with torch.no_grad():
        assert_tensor_close(hf(x).logits, m2(x), FP32_PARITY, "imported logits")


@pytest.mark.slow
def test_export_hf_at_end_of_training_and_convert_tool(tmp_path):
    from transformers import LlamaForCausalLM
    run_cli(TINY + CK + ["--training.steps=3", "--checkpoint.export_hf=true"], tmp_path)
    hf_dir = tmp_path / "run" / "checkpoint" / "hf"
    hf = LlamaForCausalLM.from_pretrained(str(hf_dir)).eval()
    # convert-tool round trip: the step-3 checkpoint to HF matches the exported one
    model_args = [a for a in TINY if a.startswith("--model.")]
    p = subprocess.run([sys.executable, "tools/convert_hf.py", "to-hf", str(tmp_path / "run" / "checkpoint" /
                        "step-00000003"), "--config", "recipes/debug_llama.toml", "--out", str(tmp_path / "conv")]
                       + model_args, cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr[-2000:]
    conv = LlamaForCausalLM.from_pretrained(str(tmp_path / "conv")).eval()
    x = torch.randint(0, 257, (1, 16))
    with torch.no_grad():
        assert torch.equal(hf(x).logits, conv(x).logits)
    # and back: from-hf makes a step-0 checkpoint that training starts from
    p = subprocess.run([sys.executable, "tools/convert_hf.py", "from-hf", str(hf_dir), "--out", str(tmp_path / "imported")],
                       cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr[-2000:]
    p = run_cli(TINY + CK + ["--training.steps=1", f"--checkpoint.folder={tmp_path / 'imported' / 'checkpoint'}"],
                tmp_path, name="from_hf")
    first = read_metrics(tmp_path, "from_hf")[0]["loss"]
    trained_last = read_metrics(tmp_path)[-1]["loss"]
    # Started from the trained weights, not from scratch: well below a fresh start's first loss, near
    # the trained run's last one (another batch: relative bounds, loose on purpose).
    assert first < 0.95 * read_metrics(tmp_path)[0]["loss"] and rel_diff(first, trained_last) < 0.3, \
        (first, trained_last, read_metrics(tmp_path)[0]["loss"])


@pytest.mark.slow
def test_last_save_model_only_in_bf16(tmp_path):
    from torch.distributed.checkpoint import FileSystemReader
    run_cli(TINY + CK + ["--training.steps=6", "--checkpoint.interval=5", "--checkpoint.last_save_model_only=true",
                         "--checkpoint.export_dtype=bfloat16"], tmp_path)
    folder = tmp_path / "run" / "checkpoint"
    full = FileSystemReader(str(folder / "step-00000005")).read_metadata().state_dict_metadata
    last = FileSystemReader(str(folder / "step-00000006")).read_metadata().state_dict_metadata
    assert any(k.startswith("optimizer") for k in full) and not any(k.startswith("optimizer") for k in last)
    assert {v.properties.dtype for k, v in last.items() if hasattr(v, "properties")} == {torch.bfloat16}
    assert json.load(open(folder / "step-00000006" / "torchmeg.json"))["model_only"] is True


OMP_TEAMS = r"""
import os, sys, torch, torch.distributed as dist
from torchmeg.runtime import process as runtime
from torchmeg.checkpoint.manager import CheckpointManager
from torchmeg.config.schema import load_config
from torchmeg.train.spike import SpikeGuard
from torchmeg.train.state import TrainState

torch.set_num_threads(2)
os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=sys.argv[2])
dist.init_process_group("gloo", rank=0, world_size=1)
cfg = load_config("recipes/debug_llama.toml", [f"--job.dump_folder={sys.argv[1]}"])
model = torch.nn.Sequential(*[torch.nn.Linear(256, 256) for _ in range(24)])
opt = torch.optim.AdamW(model.parameters())
model(torch.randn(4, 256)).sum().backward()
opt.step()
ckpt = CheckpointManager(cfg, model, opt, TrainState(8, 256, SpikeGuard(0, 1, "log")), "world 1")
threads = lambda: len(os.listdir("/proc/self/task"))
before = threads()
if sys.argv[3] == "manager":
    ckpt.save(1)
else:  # the same exchange outside the manager's guard: a gloo thread copies ~100 KB
    dist.all_gather_object([None], "x" * 100_000)
after = threads()
x = torch.randn(1 << 16)
x.mul_(1.0)  # the main team still runs
dist.barrier()
dist.destroy_process_group()
print(before, after, torch.get_num_threads())
"""


@pytest.mark.slow
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="counts threads in /proc")
@pytest.mark.parametrize("how", ["manager", "unguarded"])
def test_checkpoint_exchanges_start_no_second_openmp_team(how, tmp_path):
    """A checkpoint save (DCP's plans and metadata through gloo's worker threads) leaves no second
    OpenMP team behind: one would put libgomp over this machine's CPUs and throttle every parallel
    region of the rest of the run (measured: -15% tokens/s after the debug recipe's first save).
    The unguarded exchange shows the test can see a team start (one more thread)."""
    if (os.cpu_count() or 1) < 2:
        pytest.skip("needs two cores for a two-thread team")
    p = subprocess.run([sys.executable, "-c", OMP_TEAMS, str(tmp_path), str(free_port()), how], cwd=ROOT,
                       capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr[-3000:]
    before, after, n = map(int, p.stdout.splitlines()[-1].split())
    assert n == 2 and after == before + (0 if how == "manager" else 1), p.stdout
