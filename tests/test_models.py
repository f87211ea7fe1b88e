"""Model shapes, real-size parameter counts on the meta device, and FLOPs vs FlopCounterMode."""
import pytest
import torch
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils.flop_counter import FlopCounterMode

from torchmeg.config.schema import load_config
from torchmeg.models import build_model, count_params, flops_per_token, init_weights


def _model(name, flavor, vocab=320, device="cpu", **over):
    cfg = load_config(None, [f"--model.name={name}", f"--model.flavor={flavor}"] +
                      [f"--model.{k}={v}" for k, v in over.items()])
    return build_model(cfg, vocab, device)


@pytest.mark.parametrize("name", ["llama", "gpt2"])
def test_forward_shapes_and_backward(name):
    m = _model(name, "debug", device="meta")
    m.to_empty(device="cpu")
    init_weights(m, seed=0)
    tokens = torch.randint(0, 257, (2, 48))
    logits = m(tokens)
    assert logits.shape == (2, 48, m.args.vocab_size)
    logits.float().logsumexp(-1).mean().backward()
    assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in m.parameters())


@pytest.mark.parametrize("name, flavor, expected", [
    ("llama", "1B", 1.236e9), ("llama", "8B", 8.030e9), ("llama", "70B", 70.55e9), ("llama", "405B", 405.8e9),
    ("gpt2", "124M", 124.5e6), ("gpt2", "350M", 354.9e6), ("gpt2", "774M", 774.1e6), ("gpt2", "1.5B", 1.558e9),
    # DeepSeek-V2-Lite 15.7B and V3 671B (their papers), each + one MTP module (0.59B; 11.6B)
    ("deepseek_v3", "16B", 15.706e9 + 0.585e9), ("deepseek_v3", "671B", 671.0e9 + 11.61e9),
])
def test_real_flavors_on_meta(name, flavor, expected):
    m = _model(name, flavor, device="meta")
    n = count_params(m)
    assert abs(n - expected) / expected < 0.01, (flavor, n)
    assert all(p.device.type == "meta" for p in m.parameters())


def test_init_depends_only_on_seed_and_fqn():
    a, b = _model("llama", "debug"), _model("llama", "debug")
    del b.layers["1"]  # as a pipeline stage would hold: other modules, same names
    b.output = None
    init_weights(a, seed=3)
    init_weights(b, seed=3)
    for fqn, p in b.named_parameters():
        assert torch.equal(p, a.get_parameter(fqn)), fqn
    c = _model("llama", "debug")
    init_weights(c, seed=4)
    assert not torch.equal(c.layers["0"].attention.wq.weight, a.layers["0"].attention.wq.weight)


def test_tied_output():
    m = _model("llama", "debug", tie_embeddings=True)
    assert m.output.weight is m.tok_embeddings.weight
    assert count_params(m) == count_params(_model("llama", "debug")) - m.output.weight.numel()


@pytest.mark.parametrize("name, over", [("llama", {}), ("gpt2", {}), ("llama", {"n_kv_heads": 2}),
                                        ("llama", {"tie_embeddings": True})])
def test_flops_per_token_matches_flop_counter(name, over):
    seq, batch = 64, 2
    m = _model(name, "debug", **over)
    tokens = torch.randint(0, 257, (batch, seq))
    # The math SDPA backend decomposes attention into bmm's the counter sees (the CPU flash kernel
    # has no FLOP formula registered in torch 2.13, so it would count as zero).
    with sdpa_kernel(SDPBackend.MATH), FlopCounterMode(display=False) as fc:
        m(tokens).sum().backward()
    counted = fc.get_total_flops()
    predicted = flops_per_token(m, m.args, seq) * batch * seq
    assert abs(counted - predicted) / counted < 0.005, (counted, predicted)
