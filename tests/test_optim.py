"""LR schedules and DTensor-free grad clipping."""
import math
import re

import pytest
import torch

from torchmeg.config.schema import load_config
from torchmeg.train.optim import build_optimizer, clip_grads, describe_groups, grad_norm, lr_factor


def _cfg(**kw):
    return load_config(None, ["--training.steps=100"] + [f"--lr_scheduler.{k}={v}" for k, v in kw.items()])


def test_warmup_is_linear_and_reaches_peak():
    cfg = _cfg(warmup_steps=10)
    assert [lr_factor(s, cfg) for s in range(10)] == pytest.approx([(s + 1) / 10 for s in range(10)])


@pytest.mark.parametrize("decay", ["cosine", "linear", "constant"])
def test_decay_end_points(decay):
    cfg = _cfg(warmup_steps=10, decay_type=decay, min_lr_ratio=0.1)
    assert lr_factor(10, cfg) == pytest.approx(1.0)
    end = {"cosine": 0.1, "linear": 0.1, "constant": 1.0}[decay]
    assert lr_factor(99, cfg) == pytest.approx(end)
    mid = lr_factor(10 + 89 // 2, cfg)
    if decay == "cosine":
        assert mid == pytest.approx(0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * 44 / 89)))
    if decay == "linear":
        assert mid == pytest.approx(1 - 0.9 * 44 / 89)
    values = [lr_factor(s, cfg) for s in range(10, 100)]
    assert all(a >= b for a, b in zip(values, values[1:]))


def test_grad_norm_and_clip():
    a, b = torch.nn.Parameter(torch.zeros(3)), torch.nn.Parameter(torch.zeros(2, 2))
    a.grad, b.grad = torch.tensor([3.0, 0.0, 0.0]), torch.tensor([[0.0, 4.0], [0.0, 0.0]])
    n = grad_norm([a, b])
    assert float(n) == pytest.approx(5.0)
    clip_grads([a, b], 1.0, n)
    assert float(grad_norm([a, b])) == pytest.approx(1.0, rel=1e-5)


def test_no_weight_decay_on_norms_and_biases():
    m = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.LayerNorm(4))
    opt = build_optimizer(m, load_config(None, []))
    decayed = {id(p) for g in opt.param_groups if g["weight_decay"] > 0 for p in g["params"]}
    assert decayed == {id(m[0].weight)}


# ---- warmup-stable-decay --------------------------------------------------------------------------
def test_wsd_holds_the_peak_then_decays_over_the_last_steps():
    """steps 100, warmup 10, decay over the last 20: the peak from step 10 (0-based) to 79, then the
    shape's values, the last step at min_lr_ratio; decay_ratio 0.2 is the same schedule."""
    lin = _cfg(warmup_steps=10, decay_steps=20, decay_type="linear", min_lr_ratio=0.1)
    assert [lr_factor(s, lin) for s in (9, 10, 50, 79)] == [1.0, 1.0, 1.0, 1.0]
    assert lr_factor(80, lin) == pytest.approx(1 - 0.9 / 20)
    assert lr_factor(89, lin) == pytest.approx(1 - 0.9 * 10 / 20)
    assert lr_factor(99, lin) == pytest.approx(0.1)
    sqrt = _cfg(warmup_steps=10, decay_steps=20, decay_type="sqrt", min_lr_ratio=0.1)
    assert lr_factor(84, sqrt) == pytest.approx(0.1 + 0.9 * (1 - math.sqrt(5 / 20)))
    cos = _cfg(warmup_steps=10, decay_steps=20, decay_type="cosine", min_lr_ratio=0.0)
    assert lr_factor(89, cos) == pytest.approx(0.5)
    assert lr_factor(99, cos) == pytest.approx(0.0, abs=1e-12)
    ratio = _cfg(warmup_steps=10, decay_ratio=0.2, decay_type="linear", min_lr_ratio=0.1)
    assert [lr_factor(s, ratio) for s in range(100)] == [lr_factor(s, lin) for s in range(100)]


@pytest.mark.parametrize("over, words", [
    ({"decay_steps": 95, "warmup_steps": 10}, "a decay of 95 steps does not fit the 90 steps after warmup"),
    ({"decay_steps": 10, "decay_ratio": 0.1}, "are both set"),
    ({"decay_steps": 10, "decay_type": "constant"}, "choose the decay's shape"),
    ({"decay_ratio": 0.0}, "lr_scheduler.decay_ratio = 0.0: must be in (0, 1]"),
])
def test_wsd_keys_are_checked(over, words):
    from torchmeg.config.checks import check_recipe
    from torchmeg.config.errors import ConfigError
    with pytest.raises(ConfigError, match=re.escape(words)):
        check_recipe(_cfg(**over))


# ---- weight-decay groups --------------------------------------------------------------------------
@pytest.mark.parametrize("exempt, decayed", [
    ("norms,biases", {"tok_embeddings.weight", "output.weight", "w"}),
    ("embeddings,head,norms,biases", {"w"}),
    ("head", {"tok_embeddings.weight", "w", "norm.weight", "b"}),
    ("", {"tok_embeddings.weight", "output.weight", "w", "norm.weight", "b"}),
])
def test_weight_decay_groups(exempt, decayed):
    """optimizer.weight_decay_exempt names the kinds that never decay; the run header's line says which do."""
    class M(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.tok_embeddings = torch.nn.Embedding(10, 4)
            self.lin = torch.nn.Linear(4, 4)
            self.norm = torch.nn.LayerNorm(4, bias=False)
            self.output = torch.nn.Linear(4, 10, bias=False)
    m = M()
    names = {id(p): n for n, p in m.named_parameters()}
    names[id(m.lin.weight)], names[id(m.lin.bias)] = "w", "b"
    cfg = load_config(None, [f"--optimizer.weight_decay_exempt=[{','.join(repr(e) for e in exempt.split(',') if e)}]"])
    opt = build_optimizer(m, cfg)
    got = {names[id(p)] for g in opt.param_groups if g["weight_decay"] > 0 for p in g["params"]}
    assert got == decayed
    assert sum(len(g["params"]) for g in opt.param_groups) == 5
    line = describe_groups(opt, cfg)
    assert line.startswith("adamw ") and "(wd 0.1)" in line, line


def test_weight_decay_exempt_refuses_unknown_kinds():
    from torchmeg.config.checks import check_recipe
    from torchmeg.config.errors import ConfigError
    with pytest.raises(ConfigError, match=re.escape("optimizer.weight_decay_exempt = ['norm']: unknown group 'norm'")):
        check_recipe(load_config(None, ["--optimizer.weight_decay_exempt=['norm']"]))


# ---- bf16 optimizer states ------------------------------------------------------------------------
def _state_bytes(opt) -> int:
    return sum(t.nbytes for st in opt.state.values() for k, t in st.items() if k != "step")


@pytest.mark.parametrize("name", ["adamw", "adam", "muon"])
def test_bf16_states_halve_the_optimizer_state(name):
    """optimizer.state_dtype = "bfloat16": every moment / momentum element in 2 bytes instead of 4 (the
    weights stay float32), and the first update equals the float32-state one (the states start at zero,
    so rounding first shows in the update after)."""
    from torchmeg.models import build_model, materialize
    sizes, params = {}, {}
    for dtype in ("float32", "bfloat16"):
        cfg = load_config(None, [f"--optimizer.name={name}", f"--optimizer.state_dtype={dtype}",
                                 "--model.dim=64", "--model.n_layers=2", "--model.n_heads=4", "--model.n_kv_heads=2"])
        m = materialize(build_model(cfg, 320), "cpu", seed=0)
        opt = build_optimizer(m, cfg)
        torch.manual_seed(1)
        x = torch.randint(0, 320, (2, 16))
        torch.nn.functional.cross_entropy(m(x).flatten(0, 1), x.flatten()).backward()
        opt.step()
        states = [t for st in opt.state.values() for k, t in st.items() if k != "step"]
        assert states and {t.dtype for t in states} == {getattr(torch, dtype)}
        assert all(p.dtype == torch.float32 for p in m.parameters())
        sizes[dtype], params[dtype] = _state_bytes(opt), [p.detach().clone() for p in m.parameters()]
    assert sizes["bfloat16"] * 2 == sizes["float32"]
    for a, b in zip(params["float32"], params["bfloat16"]):
        assert torch.equal(a, b)


@pytest.mark.slow
@pytest.mark.parametrize("name", ["adamw", "muon"])
def test_bf16_states_train_like_float32_states(name, tmp_path):
    """50 steps of the tiny model: the mean loss of the last 10 steps with bf16 states within 2% of
    float32 states'. (The states' rounding, 2^-8 relative, perturbs each update by about that much; the
    trajectories part, their level does not: measured 0.4% (AdamW) and 0.03% (Muon) at step 50, where
    AdamW and Muon themselves differ by 20% at this rate.) The checkpoint holds the moments in bf16."""
    from conftest import TINY, read_metrics
    from launch import run_cli
    from test_lora import _checkpoint_tensors
    base = TINY + [f"--optimizer.name={name}", "--optimizer.lr=1e-2", "--training.steps=50",
                   "--validation.enable=false", "--checkpoint.enable=true", "--checkpoint.interval=50"]
    loss = {}
    for dtype in ("float32", "bfloat16"):
        run_cli(base + [f"--optimizer.state_dtype={dtype}"], tmp_path, name=dtype)
        rows = read_metrics(tmp_path, dtype)
        assert len(rows) == 50 and rows[-1]["loss"] < rows[0]["loss"] - 2.0
        loss[dtype] = sum(r["loss"] for r in rows[-10:]) / 10
    assert abs(loss["bfloat16"] - loss["float32"]) <= 0.02 * loss["float32"], loss
    _, meta = _checkpoint_tensors(tmp_path / "bfloat16" / "checkpoint" / "step-00000050")
    states = [m for k, m in meta.items() if k.endswith((".exp_avg", ".exp_avg_sq", ".momentum_buffer"))]
    assert states and {m.properties.dtype for m in states} == {torch.bfloat16}


@pytest.mark.slow
def test_a_stable_checkpoint_resumes_into_a_decay_of_another_length(tmp_path):
    """WSD's point: a run planned as 12 steps (decay over the last 4) saved at step 6, in its stable
    phase; resumed with training.steps 10 and a 3-step decay it takes the new schedule from step 7 and
    equals a run planned that way from the start, step for step (weights, optimizer state and data
    position taken as they were)."""
    import shutil
    from conftest import TINY, assert_parity, read_metrics
    from launch import run_cli
    base = TINY + ["--training.deterministic=true", "--lr_scheduler.decay_type=linear", "--checkpoint.enable=true",
                   "--checkpoint.keep_latest_k=0", "--validation.enable=false"]
    run_cli(base + ["--training.steps=12", "--lr_scheduler.decay_steps=4", "--checkpoint.interval=6"], tmp_path,
            name="long")
    (tmp_path / "short" / "checkpoint").mkdir(parents=True)
    shutil.copytree(tmp_path / "long" / "checkpoint" / "step-00000006",
                    tmp_path / "short" / "checkpoint" / "step-00000006")
    new = ["--training.steps=10", "--lr_scheduler.decay_steps=3", "--checkpoint.interval=10"]
    p = run_cli(base + new, tmp_path, name="short")
    assert "lr_scheduler.decay_steps 4 -> 3" in p.stdout and "training.steps 12 -> 10" in p.stdout, p.stdout[:3000]
    run_cli(base + new, tmp_path, name="planned")
    long, short, planned = (read_metrics(tmp_path, n) for n in ("long", "short", "planned"))
    assert [r["step"] for r in short] == [7, 8, 9, 10]
    assert [r["lr"] for r in long[:6]] == [r["lr"] for r in planned[:6]]  # the stable phase is shared
    cfg = load_config(None, ["--training.steps=10", "--lr_scheduler.decay_steps=3", "--lr_scheduler.decay_type=linear",
                             "--lr_scheduler.warmup_steps=2"])
    assert [r["lr"] for r in short] == pytest.approx([3e-3 * lr_factor(s, cfg) for s in range(6, 10)], rel=1e-6)
    assert short[-1]["lr"] == pytest.approx(3e-4) and long[9]["lr"] > 1e-3  # the new decay, not the old one
    assert_parity(planned[6:], short, keys=("loss", "grad_norm"))


@pytest.mark.slow
def test_resume_takes_the_state_into_new_groups_and_refuses_another_optimizers(tmp_path):
    """The optimizer state is loaded by parameter name into the groups the recipe makes now: a resume may
    change weight_decay_exempt or the states' dtype (reported); one whose optimizer keeps other state
    (adamw -> muon) is refused in one line naming the key and both ways forward."""
    from conftest import TINY
    from launch import run_cli
    base = TINY + ["--validation.enable=false", "--checkpoint.enable=true", "--checkpoint.interval=2"]
    run_cli(base + ["--training.steps=2"], tmp_path)
    p = run_cli(base + ["--training.steps=4", "--optimizer.state_dtype=bfloat16", "--optimizer.weight_decay_exempt=[]"],
                tmp_path)
    assert "optimizer.weight_decay_exempt ['norms', 'biases'] -> []" in p.stdout, p.stdout[-2000:]
    assert "optimizer.state_dtype float32 -> bfloat16" in p.stdout and "step     4 |" in p.stdout
    p = run_cli(base + ["--training.steps=6", "--optimizer.name=muon"], tmp_path, check=False)
    assert p.returncode != 0
    err = [line for line in p.stderr.splitlines() if "error" in line]
    assert len(err) == 1 and "optimizer.name = 'muon': checkpoint" in err[0] and "holds the state of 'adamw'" in err[0]
    assert "Traceback" not in p.stderr


def test_partial_gradients_are_settled_once_in_one_all_reduce_per_bucket():
    """Sequence parallel leaves a replicated weight's gradient Partial; left so, the grad norm and every
    AdamW op on it all-reduce it again (8 blocking all-reduces for two such weights). reduce_partial_grads
    settles them onto their weights' placements in one all-reduce per (mesh, placements, dtype): after it
    the norm and the update need none. The fake world's all-reduce leaves values as they are, so every
    gradient's values coming back unchanged checks the flat bucket's packing (a transposed, non-contiguous
    gradient among them); the sum itself is the TP runs' equality with one device (tests/test_parallel.py)."""
    import torch.distributed as dist  # lazy: this test's fake world only
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_tensor
    from torch.distributed.tensor.debug import CommDebugMode
    from torchmeg.plan.fake_world import fake_world
    from torchmeg.train.optim import reduce_partial_grads
    fake_world(2, 0)
    try:
        mesh = init_device_mesh("cpu", (2,))
        g = torch.Generator().manual_seed(0)
        shapes = [((4,), torch.float32), ((5, 3), torch.float32), ((6,), torch.bfloat16)]
        params, want = [], []
        for shape, dtype in shapes:
            p = torch.nn.Parameter(distribute_tensor(torch.zeros(shape, dtype=dtype), mesh, [Replicate()]))
            local = torch.randn(shape[::-1], generator=g).to(dtype).t() if len(shape) == 2 else torch.randn(shape, generator=g).to(dtype)
            p.grad = DTensor.from_local(local, mesh, [Partial()], run_check=False)
            params.append(p)
            want.append(local.clone())
        sharded = torch.nn.Parameter(distribute_tensor(torch.zeros(8, 2), mesh, [Shard(0)]))
        sharded.grad = DTensor.from_local(torch.ones(4, 2), mesh, [Shard(0)], run_check=False)
        everything = params + [sharded]
        opt = torch.optim.AdamW(everything, lr=0.1)
        with CommDebugMode() as comm:
            assert reduce_partial_grads(everything) is everything
        assert comm.get_total_counts() == 2  # one float32 bucket of two gradients, one bfloat16
        for p, w in zip(params, want):
            assert p.grad.placements == (Replicate(),) and p.grad.shape == w.shape and p.grad.dtype == w.dtype
            assert torch.equal(p.grad.to_local(), w)
        assert sharded.grad.placements == (Shard(0),) and torch.equal(sharded.grad.to_local(), torch.ones(4, 2))
        with CommDebugMode() as comm:
            grad_norm(everything)
            opt.step()
        assert comm.get_total_counts() == 1  # the sharded group's norm only: no gradient reduced again
    finally:
        dist.destroy_process_group()
