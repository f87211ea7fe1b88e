"""The LM head fused with the loss (training.fused_linear_cross_entropy, torchmeg.kernels.fused_ce): equal to
torch's head + F.cross_entropy in values and gradients (torch path and Triton kernel), no logits of
the whole batch, and the trainer in every layout it meets (TP vocab slices with and without SP,
FSDP, PP's last stage, CP, masked end-of-document targets) equal to the unfused single process."""
import json
import os
import subprocess
import sys
import textwrap

import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

from conftest import TINY, assert_close, assert_parity, read_metrics
from launch import ROOT, run_one, run_cli
from torchmeg.config.schema import load_config
from torchmeg.config.errors import ConfigError
from torchmeg.kernels.fused_ce import IGNORE, linear_cross_entropy
from torchmeg.models.args import check_model_args, model_args
from torchmeg.models.spec import get_spec

sys.path.insert(0, os.path.join(ROOT, "tools"))
from fused_ce_memory import loss_path_peak  # noqa: E402  (tools/ put on the path above)

FUSED = ["--training.fused_linear_cross_entropy=true"]


def _case(dtype, n=74, d=16, v=50, seed=0):
    g = torch.Generator().manual_seed(seed)
    h = torch.randn(2, n // 2, d, generator=g).to(dtype).requires_grad_()
    w = torch.randn(v, d, generator=g).to(dtype).requires_grad_()
    y = torch.randint(0, v, (2, n // 2), generator=g)
    y[0, :5] = IGNORE  # ignored targets inside the first chunk
    y[1, -1] = IGNORE
    return h, w, y


def _reference(h, w, y, mean_over):
    logits = h @ w.t()
    logits = logits if logits.dtype == torch.float64 else logits.float()
    total = F.cross_entropy(logits.flatten(0, 1), y.flatten(), reduction="sum")
    return total / ((y != IGNORE).sum() if mean_over == "targets" else y.numel())


# Both sides form the same products; only the order of sums differs. fp64: every value is a sum of
# at most 74 terms of magnitude <= ~10, so reordering moves it by < 74 * 10 * 2^-53 ~ 1e-13 (1e-12
# allowed). fp32: the same bound with 2^-24: ~4e-5 on the sum, and every gradient carries a 1/74
# (the mean) so it is <= 6e-7 on gradients; the loss (~5) is compared relative to its size at 1e-5
# (~170 fp32 roundings).
TOLERANCE = {torch.float64: (1e-12, 1e-12), torch.float32: (1e-5, 1e-6)}


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("mean_over", ["targets", "positions"])
@pytest.mark.parametrize("chunk", [7, 74])
def test_loss_and_gradients_equal_torch(dtype, mean_over, chunk):
    h, w, y = _case(dtype)
    loss = linear_cross_entropy(h, w, y, mean_over, chunk=chunk, use_triton=False)
    gh, gw = torch.autograd.grad(loss * 0.37, (h, w))  # an incoming gradient other than 1
    ref = _reference(h, w, y, mean_over)
    rh, rw = torch.autograd.grad(ref * 0.37, (h, w))
    tol_loss, tol_grad = TOLERANCE[dtype]
    assert_close(loss.item(), ref.item(), tol_loss, "loss")
    assert gh.dtype == dtype and gw.dtype == dtype
    assert (gh - rh).abs().max().item() <= tol_grad and (gw - rw).abs().max().item() <= tol_grad
    assert rh.abs().max() > 1e-3 and rw.abs().max() > 1e-3  # (not comparing zeros)


class _MatmulDtypes(TorchDispatchMode):
    """Input dtypes of every matmul, and the largest tensor any op makes."""

    def __init__(self):
        super().__init__()
        self.dtypes, self.largest = set(), 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func.overloadpacket in (torch.ops.aten.mm, torch.ops.aten.addmm, torch.ops.aten.addmm_):
            self.dtypes |= {a.dtype for a in args if isinstance(a, torch.Tensor)}
        for o in out if isinstance(out, (tuple, list)) else [out]:
            if isinstance(o, torch.Tensor):
                self.largest = max(self.largest, o.numel())
        return out


def test_bf16_matmuls_in_bf16_softmax_in_fp32():
    """Under bf16 the three matmuls take bf16 (as the unfused head's do) and the loss is fp32 over
    the same bf16 logits: equal to torch on those logits up to fp32 sums (1e-5 on a loss of ~5);
    the gradients within one bf16 rounding of torch's (2^-8 relative) plus the chunk sums' own
    (d W is summed over 11 chunks in bf16: up to ~11 more roundings of one ulp each, 2^-8 * 11
    relative to the largest entry)."""
    h, w, y = _case(torch.bfloat16)
    with _MatmulDtypes() as rec:
        loss = linear_cross_entropy(h, w, y, chunk=7, use_triton=False)
        gh, gw = torch.autograd.grad(loss, (h, w))
    assert rec.dtypes == {torch.bfloat16}, rec.dtypes
    assert loss.dtype == torch.float32 and gh.dtype == gw.dtype == torch.bfloat16
    ref = _reference(h, w, y, "targets")
    rh, rw = torch.autograd.grad(ref, (h, w))
    assert_close(loss.item(), ref.item(), 1e-5, "loss")
    assert (gh.float() - rh.float()).abs().max() <= 2 ** -8 * rh.float().abs().max()
    assert (gw.float() - rw.float()).abs().max() <= 11 * 2 ** -8 * rw.float().abs().max()


def test_no_logits_of_the_whole_batch():
    """The largest tensor of a fused forward + backward is one chunk's logits, not [tokens, vocab]:
    this fails if the head ran whole."""
    h, w, y = _case(torch.float32, n=64, d=4, v=1000)  # (dim 4: the weight and its gradient are smaller still)
    with _MatmulDtypes() as fused:
        linear_cross_entropy(h, w, y, chunk=8, use_triton=False).backward()
    with _MatmulDtypes() as whole:
        _reference(h, w, y, "targets").backward()
    assert whole.largest == 64 * 1000
    assert fused.largest == 8 * 1000


def test_no_gradient_work_without_grad():
    """Evaluation (no_grad) makes the logits only: one matmul per chunk."""
    h, w, y = _case(torch.float32)

    class Count(TorchDispatchMode):
        n = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func.overloadpacket in (torch.ops.aten.mm, torch.ops.aten.addmm, torch.ops.aten.addmm_):
                Count.n += 1
            return func(*args, **(kwargs or {}))
    with torch.no_grad(), Count():
        loss = linear_cross_entropy(h, w, y, chunk=10, use_triton=False)
    assert Count.n == 8  # 74 rows in chunks of 10
    assert_close(loss.item(), _reference(h, w, y, "targets").item(), 1e-5, "loss")


def test_a_second_backward_is_refused_unless_kept():
    h, w, y = _case(torch.float32)
    loss = linear_cross_entropy(h, w, y, use_triton=False)
    loss.backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="second backward"):
        loss.backward()
    h2, w2, _ = _case(torch.float32)
    kept = linear_cross_entropy(h2, w2, y, keep=True, use_triton=False)
    kept.backward(retain_graph=True)
    first = w2.grad.clone()
    kept.backward()
    assert torch.equal(w2.grad, 2 * first)


@pytest.mark.slow
def test_triton_kernel_equals_torch_under_the_interpreter():
    """The CUDA kernel (`_ce_rows_kernel`) run by Triton's interpreter on CPU tensors: each row's
    loss and its gradient over the logits equal the torch path's, and the whole fused loss equals
    torch's head + cross-entropy (fp32: 1e-5 loss, 1e-6 gradients, as the torch path's test).
    Rows span several kernel blocks (vocab 2,500 > BLOCK 1,024) and include ignored targets."""
    pytest.importorskip("triton")  # the test extra's, on Linux x86-64 (pyproject); absent elsewhere
    script = textwrap.dedent("""
        import json, torch, torch.nn.functional as F
        from torchmeg.kernels.fused_ce import IGNORE, _ce_rows_torch, _ce_rows_triton, linear_cross_entropy
        g = torch.Generator().manual_seed(0)
        logits = torch.randn(13, 2500, generator=g) * 4
        labels = torch.randint(0, 2500, (13,), generator=g)
        labels[[2, 7]] = IGNORE
        a, b = logits.clone(), logits.clone()
        la, lb = _ce_rows_torch(a, labels, 0, None), _ce_rows_triton(b, labels)
        h = torch.randn(2, 20, 32, generator=g, requires_grad=True)
        w = torch.randn(2500, 32, generator=g, requires_grad=True)
        y = torch.randint(0, 2500, (2, 20), generator=g)
        y[0, 3] = IGNORE
        loss = linear_cross_entropy(h, w, y, chunk=16, use_triton=True)
        gh, gw = torch.autograd.grad(loss, (h, w))
        ref = F.cross_entropy((h @ w.t()).flatten(0, 1), y.flatten())
        rh, rw = torch.autograd.grad(ref, (h, w))
        rel = lambda x, want: (x - want).abs().max().item() / want.abs().max().item()  # conftest's rule
        print(json.dumps({"row_loss": rel(lb, la), "row_grad": rel(b, a),
                          "ignored_zero": bool((b[2] == 0).all() and (b[7] == 0).all() and lb[2] == 0),
                          "loss": rel(loss, ref), "gh": rel(gh, rh),
                          "gw": rel(gw, rw), "grad_scale": rw.abs().max().item()}))
    """)
    p = subprocess.run([sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True, timeout=120,
                       env=dict(os.environ, TRITON_INTERPRET="1"))
    assert p.returncode == 0, p.stderr[-3000:]
    r = json.loads(p.stdout.strip().splitlines()[-1])
    assert r["ignored_zero"], r
    # relative (conftest's rule): fp32 sums in another order
    assert max(r["row_loss"], r["row_grad"], r["loss"], r["gh"], r["gw"]) <= 1e-5 and r["grad_scale"] > 1e-3, r


def test_loss_path_memory_at_a_128k_vocabulary():
    """Llama 3 8B's head (vocab 128,256, dim 4,096, bf16) on 2,048 tokens, on fake tensors: the
    fused loss path's peak is lower by more than the logits themselves (0.49 GiB)."""
    before = loss_path_peak(False, 2048, 128256, 4096, torch.bfloat16)
    after = loss_path_peak(True, 2048, 128256, 4096, torch.bfloat16)
    logits = 2048 * 128256 * 2
    assert before - after >= logits, (before, after, logits)


def test_softcapped_logits_are_refused():
    """A model that soft-caps its logits (Gemma 2/3) in its own head cannot have it fused: refused
    before anything is built, naming the key."""
    cfg = load_config("recipes/hf_llama_debug.toml", FUSED)
    args = model_args(cfg, 320)
    args.config.final_logit_softcapping = 30.0
    with pytest.raises(ConfigError, match="training.fused_linear_cross_entropy = true: this model soft-caps"):
        check_model_args(cfg, get_spec("hf"), args, None)
    check_model_args(load_config("recipes/hf_llama_debug.toml", []), get_spec("hf"), args, None)  # (unfused: fine)


# ---- the trainer, fused, against the unfused single process ------------------------------------

P = "--parallelism."
BASE = TINY + ["--training.steps=4", "--training.deterministic=true", "--training.global_batch_size=8"]
LAYOUTS = {
    # name: (ranks, local batch, layout)
    "single": (1, 8, []),
    "tp2_sp": (2, 8, [P + "tensor_parallel_degree=2", P + "data_parallel_shard_degree=1"]),
    "tp2_no_sp": (2, 8, [P + "tensor_parallel_degree=2", P + "data_parallel_shard_degree=1",
                         P + "sequence_parallel=false"]),
    "fsdp2_tp2": (4, 4, [P + "data_parallel_shard_degree=2", P + "tensor_parallel_degree=2"]),
    "pp2_zbv": (2, 8, [P + "pipeline_parallel_degree=2", P + "data_parallel_shard_degree=1",
                       P + "pipeline_parallel_schedule=ZBVZeroBubble", P + "pipeline_parallel_microbatches=4",
                       P + "pipeline_parallel_layers_per_stage=[0, 1, 1, 0]"]),  # (the head on stage 3: rank 0's)
}


@pytest.fixture(scope="module")
def unfused(tmp_path_factory):
    d = tmp_path_factory.mktemp("unfused")
    run_cli(BASE + ["--training.local_batch_size=8"], d)
    return read_metrics(d)


@pytest.mark.slow
@pytest.mark.parametrize("name", list(LAYOUTS))
def test_trainer_fused_equals_unfused(name, tmp_path, unfused):
    """fp32, deterministic: 1e-5 on loss, grad norm and val_loss at every step (conftest's parity)."""
    ranks, local, layout = LAYOUTS[name]
    p = run_cli(BASE + [f"--training.local_batch_size={local}"] + layout + FUSED, tmp_path, nproc=ranks)
    assert "fused with the LM head 'output'" in p.stdout
    assert_parity(unfused, read_metrics(tmp_path))


@pytest.mark.slow
@pytest.mark.parametrize("name, nproc, layout", [
    ("cp2", 2, [P + "context_parallel_degree=2", P + "data_parallel_shard_degree=1"]),
    ("fsdp2", 2, [P + "data_parallel_shard_degree=2", "--training.local_batch_size=2"]),
])
def test_fused_with_documents_and_masked_eod(name, nproc, layout, short_docs, tmp_path):
    """Short documents, attention within documents and end-of-document targets masked (the loss
    divides by all positions): fused under CP2 / FSDP2 equals unfused on one process."""
    args = TINY + ["--training.steps=4", "--training.deterministic=true", "--training.global_batch_size=4",
                   f"--data.dataset={short_docs}", "--data.document_masking=true", "--data.mask_eod_loss=true"]
    run_cli(args + ["--training.local_batch_size=4"], tmp_path, name="ref")
    run_cli(args + layout + FUSED, tmp_path, nproc=nproc, name=name)
    assert_parity(read_metrics(tmp_path, "ref"), read_metrics(tmp_path, name))


@pytest.mark.slow
def test_planner_accounts_for_the_fused_head(tmp_path):
    """The 8B recipe planned with and without the fused head: rank 0's peak drops by at least the
    logits of its microbatch (8,192 tokens x 128,256 x bf16 = 1.96 GiB)."""
    peaks = {}
    for fused in (False, True):
        text = open(os.path.join(ROOT, "recipes/llama3_8b.toml")).read()
        if fused:
            text = text.replace("[training]\n", "[training]\nfused_linear_cross_entropy = true\n", 1)
        recipe = tmp_path / f"r{fused}.toml"
        recipe.write_text(text)
        out = tmp_path / f"p{fused}.json"
        p = run_one([sys.executable, "-m", "torchmeg.plan", "--config", str(recipe), "--json", str(out)],
                     dict(os.environ), 120)
        assert p.returncode == 0, p.stderr[-3000:]
        peaks[fused] = json.loads(out.read_text())["ranks"][0]["peak_bytes"]
    assert peaks[False] - peaks[True] >= 8192 * 128256 * 2, peaks
