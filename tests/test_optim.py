"""LR schedules and DTensor-free grad clipping."""
import math

import pytest
import torch

from torchmeg.config.schema import load_config
from torchmeg.train.optim import build_optimizer, clip_grads, grad_norm, lr_factor


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
