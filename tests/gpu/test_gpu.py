"""The CUDA paths no CPU run can reach: `pytest tests/gpu` on a machine with one GPU or more
(two for the tests marked so). Skipped where CUDA is absent, as in CI.

Each test says what it checks; README "GPU suite" lists them. They run the real CLIs, as the CPU
suite does, on device "cuda" with NCCL.
"""
import json
import statistics
import subprocess
import sys

import pytest
import torch

from conftest import assert_parity, assert_tensor_close, read_metrics
from launch import ROOT, run_cli

CUDA = torch.cuda.is_available()
N_GPU = torch.cuda.device_count() if CUDA else 0
# slow: each launches a run or holds the device for seconds (the quick tier launches no process)
pytestmark = [pytest.mark.skipif(not CUDA, reason="needs a CUDA GPU: run `pytest tests/gpu` on a GPU machine"),
              pytest.mark.slow]
two_gpus = pytest.mark.skipif(N_GPU < 2, reason="needs 2 GPUs")
fp8_gpu = pytest.mark.skipif(not CUDA or torch.cuda.get_device_capability() < (8, 9),
                             reason="needs a GPU with float8 matmuls (sm_89+: L40S, H100, ...)")

RECIPE = ["--config", "recipes/debug_llama.toml", "--metrics.enable_tensorboard=false", "--training.device=cuda"]


def _ops(path):
    return json.loads(open(f"{path}.rank0.json").read())


def test_bf16_fsdp_trains_in_bf16(tmp_path):
    """bf16 through FSDP2's policy on the GPU(s): every matmul and attention op in step 1 takes bf16
    operands (recorded, not assumed), the loss falls, memory is the CUDA allocator's, MFU is
    against the datasheet peak (0 < mfu < 1), and the tensors' peak is logged beside it, within it."""
    n = min(2, N_GPU)
    run_cli(RECIPE + ["--training.steps=40", "--training.mixed_precision=bf16",
                      f"--training.local_batch_size={8 // n}"], tmp_path, nproc=n, timeout=600,
            env={"TORCHMEG_RECORD_OPS": str(tmp_path / "ops")})
    ops = _ops(tmp_path / "ops")
    assert all(dt == ["bfloat16"] for dt in ops["matmul_dtypes"].values()), ops["matmul_dtypes"]
    rows = read_metrics(tmp_path)
    assert rows[-1]["loss"] < rows[0]["loss"] - 1.0
    assert all(0 < r["mfu"] < 1 and r["memory_gib"] > 0 for r in rows[1:])
    assert all(0 < r["memory_allocated_gib"] <= r["memory_gib"] for r in rows), rows[-1]


@fp8_gpu
@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise"])
def test_float8_real_matmuls(recipe, tmp_path):
    """torchao float8 with the hardware's own float8 matmuls (emulate = false): the blocks' 28
    Linears converted, `_scaled_mm` ran in step 1, and the held-out loss at step 50 is within 5% of
    the bf16 run's."""
    common = RECIPE + ["--training.steps=50", "--training.mixed_precision=bf16", "--validation.freq=50",
                       "--validation.steps=8"]
    run_cli(common, tmp_path, name="bf16", timeout=600)
    run_cli(common + ["--float8.enable=true", f"--float8.recipe={recipe}", "--float8.emulate=false"], tmp_path,
            name="fp8", timeout=600, env={"TORCHMEG_RECORD_OPS": str(tmp_path / "ops")})
    ops = _ops(tmp_path / "ops")
    assert len(ops["float8_modules"]) == 28 and "_scaled_mm" in ops["matmul_dtypes"], ops
    a, b = read_metrics(tmp_path, "bf16")[-1], read_metrics(tmp_path, "fp8")[-1]
    assert abs(b["val_loss"] - a["val_loss"]) <= 0.05 * a["val_loss"], (a["val_loss"], b["val_loss"])


@pytest.mark.parametrize("dtype, tol", [(torch.float32, 2e-5), (torch.bfloat16, 3e-2)])
def test_context_parallel_block_kernels_on_cuda(dtype, tol):
    """The CUDA kernels of context-parallel block attention (memory-efficient SDPA with its
    log-sum-exp, forward and backward, torchmeg.parallel.context._pair_fwd/_pair_bwd) over the
    load-balanced chunks of cp = 2, merged with the online-softmax rule: equal to dense causal
    attention, output and q/k/v gradients. (fp32: kernel rounding; bf16: 8 significant bits.)"""
    from torchmeg.parallel import context as C
    torch.manual_seed(0)
    B, H, L, D, cp = 2, 8, 512, 64, 2
    q, k, v, do = (torch.randn(B, H, L, D, device="cuda", dtype=dtype) for _ in range(4))
    ref = [t.clone().requires_grad_() for t in (q, k, v)]
    out_ref = torch.nn.functional.scaled_dot_product_attention(*ref, is_causal=True)
    out_ref.backward(do)
    c = L // (2 * cp)
    chunk = lambda t, i: t[:, :, i * c:(i + 1) * c]  # noqa: E731
    out, dq, dk, dv = (torch.zeros_like(t, dtype=torch.float32) for t in (q, q, k, v))
    for i in range(2 * cp):  # every query chunk against the key chunks at or before it
        o, lse, parts = None, None, []
        for j in range(i + 1):
            o_j, lse_j, aux = C._pair_fwd(chunk(q, i), chunk(k, j), chunk(v, j), i == j)
            o, lse = C._merge(o, lse, o_j, lse_j)
            parts.append((j, aux))
        o = o.to(dtype)
        chunk(out, i).copy_(o)
        for j, aux in parts:
            a, b_, c_ = C._pair_bwd(chunk(do, i), chunk(q, i), chunk(k, j), chunk(v, j), o, lse, i == j, aux)
            chunk(dq, i).add_(a.float())
            chunk(dk, j).add_(b_.float())
            chunk(dv, j).add_(c_.float())
    for got, want in ((out, out_ref), (dq, ref[0].grad), (dk, ref[1].grad), (dv, ref[2].grad)):
        assert_tensor_close(got, want.float(), tol, "CP block kernel")


def test_document_masking_runs_flex_attention_on_cuda():
    """Document masking on CUDA runs FlexAttention with a block mask built on the device
    (models.flex_documents): output and q/k/v gradients equal the SDPA path's on CPU (piece by
    piece over the documents), a CP chunk (q_start > 0) and GQA included; the device path never
    reads the document boundaries to the host (the SDPA path's one read per forward). fp32; flex's
    Triton kernel may take its dot products in TF32 (10-bit mantissa, 2^-11 relative per product):
    bound 2^-9."""
    from torchmeg.models.attention import DocumentBatch, document_attention
    torch.manual_seed(0)
    B, H, K, S, D = 2, 8, 4, 512, 64
    docs = torch.zeros(B, S, dtype=torch.int64)
    docs[0, 100:], docs[0, 300:], docs[1] = 1, 2, torch.arange(S) // 37
    for q_start, L in ((0, S), (192, 128)):
        inputs = [torch.randn(B, H, L, D), torch.randn(B, K, S, D), torch.randn(B, K, S, D)]
        cpu = [t.clone().requires_grad_() for t in inputs]
        gpu = [t.cuda().requires_grad_() for t in inputs]
        batch = DocumentBatch(docs.cuda())
        out_gpu = document_attention(*gpu, batch, q_start)
        assert batch._spans is None  # the device path never read the document boundaries to the host
        out_cpu = document_attention(*cpu, docs, q_start)
        do = torch.randn_like(out_cpu)
        out_gpu.backward(do.cuda())
        out_cpu.backward(do)
        assert_tensor_close(out_gpu.cpu(), out_cpu, 2 ** -9, "flex forward")
        for g, c in zip(gpu, cpu):
            assert_tensor_close(g.grad.cpu(), c.grad, 2 ** -9, "flex backward")


def test_moe_routing_and_experts_never_sync_the_device():
    """The MoE model's routing counts (models.moe.expert_counts: a scatter-add into a fixed-size
    buffer) and its grouped experts, forward and backward in bf16 on the GPU, under
    torch.cuda.set_sync_debug_mode("error"): any device-to-host read (.item(), bincount's size read,
    nonzero) raises. The check sees such reads: torch.bincount of the same ids raises under it."""
    from torchmeg.config.schema import load_config
    from torchmeg.models import build_model, init_weights
    model = build_model(load_config("recipes/moe_debug.toml", []), 257, "cuda")
    init_weights(model, seed=0)
    model = model.to(torch.bfloat16)
    x = torch.randint(0, 257, (4, 64), device="cuda")
    model(x).float().pow(2).mean().backward()  # warm-up: the libraries' first calls may sync once
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        model(x).float().pow(2).mean().backward()
        with pytest.raises(RuntimeError, match="synchroniz"):
            torch.bincount(x.flatten())
    finally:
        torch.cuda.set_sync_debug_mode(0)


def test_muon_and_bf16_states_on_cuda():
    """On the GPU (cuBLAS matmuls, bf16 Newton-Schulz on tensor cores): build_optimizer's Muon groups on
    the debug Llama = torch.optim.Muon + torch.optim.AdamW bit for bit over 4 steps; bf16 states hold
    exactly half the bytes of float32 states."""
    import copy
    from torchmeg.config.schema import load_config
    from torchmeg.models import build_model, init_weights
    from torchmeg.train.optim import build_optimizer
    cfg = load_config("recipes/debug_llama.toml", ["--optimizer.name=muon", "--optimizer.lr=1e-2"])
    model = build_model(cfg, 320, "cuda")
    init_weights(model, seed=0)
    ref = copy.deepcopy(model)
    opt = build_optimizer(model, cfg)
    named = dict(ref.named_parameters())
    head = ("tok_embeddings", "output")
    mats = [p for n, p in named.items() if p.ndim == 2 and not n.startswith(head)]
    o = cfg.optimizer
    ref_opts = [torch.optim.Muon(mats, lr=o.lr, weight_decay=o.weight_decay, adjust_lr_fn="match_rms_adamw"),
                torch.optim.AdamW([{"params": [p for n, p in named.items() if p.ndim == 2 and n.startswith(head)]},
                                   {"params": [p for p in named.values() if p.ndim < 2], "weight_decay": 0.0}],
                                  lr=o.lr, betas=tuple(o.betas), eps=o.eps, weight_decay=o.weight_decay,
                                  foreach=False)]
    torch.manual_seed(0)
    for _ in range(4):
        x = torch.randint(0, 320, (2, 64), device="cuda")
        for m, opts in ((model, [opt]), (ref, ref_opts)):
            torch.nn.functional.cross_entropy(m(x).flatten(0, 1), x.flatten()).backward()
            for op in opts:
                op.step()
                op.zero_grad()
    for (n, a), b in zip(model.named_parameters(), ref.parameters()):
        assert torch.equal(a, b), n
    sizes = {}
    for dtype in ("float32", "bfloat16"):
        c = load_config("recipes/debug_llama.toml", [f"--optimizer.state_dtype={dtype}"])
        m = build_model(c, 320, "cuda")
        init_weights(m, seed=0)
        op = build_optimizer(m, c)
        m(x).float().pow(2).mean().backward()
        op.step()
        sizes[dtype] = sum(t.nbytes for st in op.state.values() for k, t in st.items() if k != "step")
    assert sizes["bfloat16"] * 2 == sizes["float32"] > 0


@two_gpus
def test_async_tensor_parallel_matches_plain_tp(tmp_path):
    """Inductor's micro-pipelined TP (symmetric-memory collectives, compile on) trains as plain
    compiled TP2 does, step by step (1e-4 relative: the matmuls are cut into pieces), and it really
    ran: the generated code calls the fused collective matmuls (all-gather + matmul, matmul +
    reduce-scatter), which plain compiled TP never does."""
    common = RECIPE + ["--training.steps=8", "--parallelism.tensor_parallel_degree=2", "--compile.enable=true",
                       "--metrics.log_freq=1", "--training.deterministic=true"]
    run_cli(common, tmp_path, nproc=2, name="tp", timeout=900)
    code = {"TORCH_LOGS": "output_code"}
    plain = run_cli(common, tmp_path, nproc=2, name="tp_code", timeout=900, env=code)
    fused = run_cli(common + ["--parallelism.enable_async_tensor_parallel=true"], tmp_path, nproc=2, name="async",
                    timeout=900, env=code)
    for op in ("fused_all_gather_matmul", "fused_matmul_reduce_scatter"):
        assert op in fused.stderr, f"async TP on, but no {op} in the generated code"
        assert op not in plain.stderr, f"plain TP generated {op}"
    assert_parity(read_metrics(tmp_path, "tp"), read_metrics(tmp_path, "async"), rtol=1e-4, keys=("loss",))


def test_cuda_memory_snapshot_is_written(tmp_path):
    """[profiling] with memory on a GPU: each window writes the allocator's history, a pickle that
    pytorch.org/memory_viz reads (segments and traces inside)."""
    import pickle
    run_cli(RECIPE + ["--training.steps=6", "--profiling.enable=true", "--profiling.profile_freq=5",
                      "--profiling.active_steps=2"], tmp_path, timeout=600)
    snap = tmp_path / "run" / "profile" / "step-000005" / "rank0.memory_snapshot.pickle"
    data = pickle.load(open(snap, "rb"))
    assert data["segments"] and "device_traces" in data


@two_gpus
def test_nccl_failure_on_one_rank_ends_the_job_in_seconds(tmp_path):
    """A rank that raises in step 3 under NCCL: both ranks are gone within 60 s (the collective
    timeout is 300), the root cause printed once by the rank that had it."""
    import time
    t0 = time.time()
    p = run_cli(RECIPE + ["--training.steps=50", "--parallelism.data_parallel_shard_degree=2"], tmp_path, nproc=2,
                check=False, timeout=300, env={"TORCHMEG_TEST_RAISE_AT_STEP": "3", "TORCHMEG_TEST_FAULT_RANK": "1"})
    assert p.returncode != 0 and time.time() - t0 < 90
    assert "injected failure at step 3 on rank 1" in p.stderr


@pytest.mark.parametrize("name, extra", [
    ("debug", ["--training.mixed_precision=bf16"]),
    ("1B", ["--model.flavor=1B", "--data.seq_len=2048", "--training.local_batch_size=4",
            "--training.mixed_precision=bf16", "--activation_checkpoint.mode=selective", "--data.document_masking=false"]),
])
def test_planner_step_time_against_a_real_run(name, extra, tmp_path):
    """The planner's predicted step time against the measured median step of a real run on this GPU,
    within 1.5x either way (a plan off by more than that cannot size a cluster); the ratio is
    printed for the README."""
    from torchmeg.plan.gpus import key_for_device
    key = key_for_device(torch.cuda.get_device_name())
    if key is None:
        pytest.skip(f"{torch.cuda.get_device_name()}: not in the planner's GPU table")
    args = RECIPE + extra + ["--training.steps=30", "--metrics.log_freq=1", "--validation.enable=false",
                             "--checkpoint.enable=false"]
    plan = subprocess.run([sys.executable, "-m", "torchmeg.plan", "--world", "1", "--gpu", key, "--json",
                           str(tmp_path / "plan.json")] + args, cwd=ROOT, capture_output=True, text=True, timeout=900)
    assert plan.returncode == 0, plan.stderr[-3000:]
    predicted = json.load(open(tmp_path / "plan.json"))["step_s"]
    run_cli(args, tmp_path, timeout=900)
    measured = statistics.median(r["elapsed_ms"] for r in read_metrics(tmp_path)[10:]) / 1000
    print(f"\n{name} on {torch.cuda.get_device_name()}: predicted {predicted:.4f} s, measured {measured:.4f} s, "
          f"measured / predicted = {measured / predicted:.2f}")
    assert predicted / 1.5 <= measured <= 1.5 * predicted, (measured, predicted)
