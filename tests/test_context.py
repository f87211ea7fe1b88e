"""Context parallel: the sequence split over ranks trains exactly like one process, in every mode."""
import json
import os
import subprocess
import sys

import pytest
import torch

from conftest import FP32_PARITY, reference_run, TINY, assert_parity, read_metrics
from launch import ROOT, launch_ranks, run_cli, run_one
from torchmeg.config.schema import ConfigError, load_config
from torchmeg.train.validate import validate
from torchmeg.parallel.context import positions, shard_sequence

P = "--parallelism."
BASE = TINY + ["--training.steps=4", "--training.deterministic=true", "--training.global_batch_size=4"]


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    cache = {}

    def get(model=()):
        if model not in cache:
            cache[model] = reference_run(tmp_path_factory, _args(model) + ["--training.local_batch_size=4"])
        return cache[model]
    return get


def _args(model):
    if model == ("gpt2",):
        return [a for a in BASE if not a.startswith(("--model.n_kv_heads", "--model.multiple_of"))] + ["--model.name=gpt2"]
    if model == ("kv4",):  # alltoall at cp 4 splits kv heads 4 ways
        return BASE + ["--model.n_kv_heads=4"]
    return list(BASE)


M = P + "context_parallel_mode="


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["allgather", "ring"])  # alltoall cannot split 2 kv heads 8 ways
def test_128k_recipe_attention_needs_no_local_by_seq_tensor(mode):
    """recipes/llama3_8b_long_context.toml's attention (seq 131072, CP 8, heads 32/8 under TP 4 ->
    8/2 per rank, head dim 128), planned under FakeTensorMode: no op produces a tensor of
    local_len x seq_len elements (one head's mask or score matrix)."""
    p = run_one([sys.executable, os.path.join(ROOT, "tests", "cp_kernel_worker.py"), "planned", mode,
                 "8", "131072", "8", "2", "128"], dict(os.environ), 240)
    assert p.returncode == 0, p.stderr[-3000:]
    r = json.loads(p.stdout.strip().splitlines()[-1])
    assert r["largest"] < r["local_x_seq"] // 8, r  # the largest is K/V-sized, not mask-sized


@pytest.mark.slow
@pytest.mark.timeout(500)  # (its run's own bound, 400 s, fires first with the run's output)
def test_attention_memory_at_8k_is_a_quarter_of_the_dense_kernel(tmp_path):
    """tools/cp_bench.py at seq 8192, CP 2: peak memory of the attention path (VmHWM above the
    inputs) of block attention (default mode) vs the dense-mask kernel torchmeg had before; and
    the bytes (README's table has every mode)."""
    p = subprocess.run([sys.executable, "tools/cp_bench.py", "--seq", "8192", "--modes", "dense,allgather",
                        "--steps", "1", "--out", str(tmp_path)], cwd=ROOT, capture_output=True, text=True, timeout=400)
    assert p.returncode == 0, p.stderr[-3000:]
    rows = {r["mode"]: r for r in json.load(open(tmp_path / "cp_bench.json"))}
    assert rows["allgather"]["attn_mem_mib"] <= rows["dense"]["attn_mem_mib"] / 4, rows
    assert rows["allgather"]["comm_bytes"] * 2 == rows["dense"]["comm_bytes"]  # heads 4 / kv heads 2
    assert os.path.getsize(tmp_path / "cp_bench.png") > 1000


@pytest.mark.slow
@pytest.mark.parametrize("name, ranks, local, layout, model", [
    ("cp2_allgather", 2, 4, [P + "context_parallel_degree=2", M + "allgather"], ()),
    ("cp2_ring", 2, 4, [P + "context_parallel_degree=2", M + "ring"], ()),
    ("cp2_alltoall", 2, 4, [P + "context_parallel_degree=2", M + "alltoall"], ()),
    ("cp4_allgather", 4, 4, [P + "context_parallel_degree=4", M + "allgather"], ()),
    ("cp4_ring", 4, 4, [P + "context_parallel_degree=4", M + "ring"], ()),
    ("cp4_alltoall", 4, 4, [P + "context_parallel_degree=4", M + "alltoall"], ("kv4",)),
    ("cp2_tp2_ring", 4, 4, [P + "context_parallel_degree=2", P + "tensor_parallel_degree=2", M + "ring"], ()),
    ("cp2_fsdp2_allgather", 4, 2, [P + "context_parallel_degree=2", P + "data_parallel_shard_degree=2"], ()),
    ("cp2_pp2_ring", 4, 4, [P + "context_parallel_degree=2", P + "pipeline_parallel_degree=2", M + "ring"], ()),
    # the second stage takes the hidden state sequence-sharded over TP (SP): its positions are its CP shard's
    ("cp2_pp2_tp2_sp", 8, 4, [P + "context_parallel_degree=2", P + "pipeline_parallel_degree=2",
                              P + "tensor_parallel_degree=2", P + "data_parallel_shard_degree=1",
                              "--data.document_masking=false"], ()),
    ("gpt2_cp2_alltoall", 2, 4, [P + "context_parallel_degree=2", M + "alltoall"], ("gpt2",)),
])
def test_cp_matches_single_process(name, ranks, local, layout, model, tmp_path, reference):
    p = run_cli(_args(model) + [f"--training.local_batch_size={local}"] + layout, tmp_path, nproc=ranks)
    assert "cp=" in p.stdout
    assert_parity(reference(model), read_metrics(tmp_path))  # train loss, grad norm and val_loss


def _kernel_run(mode, cp, L, H, K, D=8):
    """tests/cp_kernel_worker.py on cp ranks: per-rank errors vs one device, work and bytes (rank 0
    prints every rank's row). The ranks are forked from the suite's zygote, not started by torchrun:
    the worker is the subject, not the launcher (torchrun's agent is tested in test_multinode)."""
    cmd = [sys.executable, os.path.join(ROOT, "tests", "cp_kernel_worker.py"), mode, str(cp), str(L), str(H), str(K),
           str(D)]
    p = launch_ranks(cmd, cp, dict(os.environ), timeout=240)
    assert p.returncode == 0, p.stderr[-3000:] + getattr(p, "rank_tails", "")
    return [json.loads(line) for line in p.stdout.splitlines() if line.startswith("{")]


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["allgather", "ring", "alltoall"])
@pytest.mark.parametrize("cp, H, K", [(2, 4, 2), (4, 8, 4)])
def test_cp_attention_kernel_matches_one_device(mode, cp, H, K):
    """Output and q/k/v gradients of each mode vs causal SDPA on the whole sequence (GQA), and the
    work done: exactly the causal half plus the diagonal chunk pairs, no block above it."""
    B, L = 2, 64
    rows = _kernel_run(mode, cp, L, H, K)
    assert len(rows) == cp
    for r in rows:
        assert max(r["out"], r["dq"], r["dk"], r["dv"]) < FP32_PARITY, r
    c, n = L // (2 * cp), 2 * cp
    causal = B * H * (n * (n - 1) // 2 * c * c + n * c * c / 2)  # full pairs below + half the diagonal
    assert sum(r["pairs"] for r in rows) == causal
    if mode == "allgather":  # K/V gathered with the kv heads, repeated to the H query heads only after
        kv_bytes = 2 * B * K * (L // cp) * 8 * 4  # k and v: B x kv heads x local tokens x D 8 x fp32
        assert all(r["comm"]["c10d_functional.all_gather_into_tensor"] == kv_bytes for r in rows), rows[0]["comm"]


def test_load_balanced_layout():
    seq = torch.arange(16).view(1, 16)
    shards = [shard_sequence(seq, r, 2) for r in range(2)]
    assert shards[0].tolist() == [[0, 1, 2, 3, 12, 13, 14, 15]] and shards[1].tolist() == [[4, 5, 6, 7, 8, 9, 10, 11]]
    for r in range(2):
        assert positions(8, r, 2).tolist() == shards[r][0].tolist()
    # each rank does the same amount of causal attention work
    work = [sum(int(p) + 1 for p in positions(8, r, 2)) for r in range(2)]
    assert work[0] == work[1]


def test_bad_cp_layouts():
    cfg = load_config(None, TINY + ["--data.seq_len=34", P + "context_parallel_degree=2"])
    with pytest.raises(ConfigError, match="data.seq_len = 34: context parallel 2 needs a multiple of 4"):
        validate(cfg, world_size=2)
    cfg = load_config(None, TINY + ["--data.seq_len=36", P + "context_parallel_degree=2", P + "tensor_parallel_degree=2"])
    with pytest.raises(ConfigError, match="multiple of 8"):
        validate(cfg, world_size=4)
    cfg = load_config(None, TINY + [P + "context_parallel_degree=4", P + "context_parallel_mode=alltoall"])
    with pytest.raises(ConfigError, match="n_kv_heads = 2 is not divisible by context_parallel_degree x "
                                          "tensor_parallel_degree = 4"):
        validate(cfg, world_size=4)


@pytest.mark.slow
def test_recompute_drops_the_gathered_kv(tmp_path):
    """Under full recompute a block holds only its input from forward to backward, in every CP mode:
    allgather's K/V of the whole sequence go through save_for_backward and are gathered again when
    the block is recomputed. Four more layers add the same bytes under allgather as under alltoall
    (which gathers nothing); with the K/V on the autograd ctx they added 4 layers' K/V more (1 MiB
    each here). Measured with the planner's fake-tensor step (the real run's tracker agrees to the
    byte: tests/test_plan.py)."""
    from launch import run_one
    held = {}
    for mode in ("allgather", "alltoall"):
        for n in (4, 8):
            out = tmp_path / f"{mode}{n}.json"
            p = run_one([sys.executable, "-m", "torchmeg.plan", "--config", os.path.join(ROOT, "recipes", "debug_llama.toml"),
                          "--world", "2", "--json", str(out), "--parallelism.context_parallel_degree=2",
                          f"--parallelism.context_parallel_mode={mode}", "--activation_checkpoint.mode=full",
                          "--data.seq_len=1024", "--training.local_batch_size=1", "--data.document_masking=false",
                          "--parallelism.data_parallel_shard_degree=1", f"--model.n_layers={n}"],
                         dict(os.environ, OMP_NUM_THREADS="1"), 120)
            assert p.returncode == 0, p.stderr[-2000:]
            held[mode, n] = json.load(open(out))["ranks"][0]["activation_bytes"]
    per_4_layers = {m: held[m, 8] - held[m, 4] for m in ("allgather", "alltoall")}
    assert per_4_layers["allgather"] == per_4_layers["alltoall"] > 0, per_4_layers
