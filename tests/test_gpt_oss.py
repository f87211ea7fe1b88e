"""gpt-oss natively: every layout of the debug recipe (sinks, windowed and full layers, biased router
and experts with the clamped SwiGLU, YaRN) equals one process (the parity rule); generation from the
cache equals recomputing; context parallel is refused in one line. transformers' logits and greedy
tokens, and MXFP4 / FP8 folders: tests/test_convert.py, tests/test_hf_quant.py."""
import pytest
import torch

from conftest import FP32_PARITY, assert_parity, assert_tensor_close, read_metrics, reference_run
from launch import run_cli
from torchmeg.config.schema import ConfigError, load_config
from torchmeg.models import build_model, init_weights
from torchmeg.models.kv_cache import KVCache
from torchmeg.train.validate import validate

P = "--parallelism."
OSS = ["--config", "recipes/gpt_oss_debug.toml", "--data.seq_len=48", "--training.steps=4",
       "--training.deterministic=true", "--training.global_batch_size=8", "--lr_scheduler.warmup_steps=2",
       "--metrics.log_freq=1", "--metrics.enable_tensorboard=false", "--validation.enable=true", "--validation.steps=2",
       "--validation.freq=4"]


def _model(**over):
    cfg = load_config(None, ["--model.name=gpt_oss", "--model.flavor=debug"] + [f"--model.{k}={v}" for k, v in over.items()])
    m = build_model(cfg, 257, "cpu")
    init_weights(m, seed=0)
    with torch.no_grad():  # biases and sinks away from their zero / small init, so each one counts
        for n, p in m.named_parameters():
            if n.endswith((".bias", "sinks.weight", ".b1", ".b2", ".b3")):
                p.normal_(0, 0.5)
    return m.eval()


def test_cache_decode_equals_recompute_across_the_window():
    """Prefill 20 tokens, then decode 20 one at a time past the 16-token window: every step's logits
    equal the full forward's at that position (left-padded rows included)."""
    m = _model()
    x = torch.randint(0, 257, (2, 40), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        want = m(x)
        cache = KVCache(2, 48)
        got = [m(x[:, :20], positions=cache.positions(20), cache=cache)]
        cache.advance(20)
        for i in range(20, 40):
            got.append(m(x[:, i:i + 1], positions=cache.positions(1), cache=cache))
            cache.advance(1)
    assert_tensor_close(torch.cat(got, 1), want, FP32_PARITY, "gpt_oss cached decode")


def test_document_masking_equals_each_document_alone():
    m = _model()
    a, b = (torch.randint(0, 257, (1, n), generator=torch.Generator().manual_seed(n)) for n in (30, 18))
    docs = torch.tensor([[0] * 30 + [1] * 18])
    with torch.no_grad():
        packed = m(torch.cat([a, b], 1), documents=docs)
        assert_tensor_close(packed, torch.cat([m(a), m(b)], 1), FP32_PARITY, "documents")


# The reference steps in two microbatches of 4 rows, as every layout below: gpt-oss balances its
# experts with the Switch loss, a product of two batch means, so it is computed per microbatch (as
# Megatron's default) and a step over one microbatch of 8 has other gradients (~1e-3 relative on
# the routers, measured) than two of 4: a different run, not a different layout.
@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    return reference_run(tmp_path_factory, OSS + ["--training.local_batch_size=4"])


LAYOUTS = [
    ("fsdp2", 2, 4, []),
    ("tp2", 2, 4, [P + "tensor_parallel_degree=2", P + "data_parallel_shard_degree=1"]),
    ("ep2_fsdp2", 2, 4, [P + "expert_parallel_degree=2"]),
    ("tp2_ep2_fsdp2", 4, 4, [P + "tensor_parallel_degree=2", P + "expert_parallel_degree=2"]),
    ("pp2", 2, 8, [P + "pipeline_parallel_degree=2", P + "pipeline_parallel_microbatches=2"]),
]


@pytest.mark.slow
@pytest.mark.parametrize("name, ranks, local, layout", LAYOUTS, ids=[x[0] for x in LAYOUTS])
def test_gpt_oss_layouts_match_single_process(name, ranks, local, layout, tmp_path, reference):
    run_cli(OSS + [f"--training.local_batch_size={local}"] + layout, tmp_path, nproc=ranks)
    got = read_metrics(tmp_path)
    assert_parity(reference, got, keys=("loss", "grad_norm", "val_loss"))
    for a, b in zip(reference, got):
        assert a["tokens_per_expert"] == b["tokens_per_expert"]  # the same routing, globally


def test_context_parallel_is_refused_in_one_line():
    cfg = load_config("recipes/gpt_oss_debug.toml", [P + "context_parallel_degree=2"])
    with pytest.raises(ConfigError) as e:
        validate(cfg, world_size=2, data=False)
    msg = str(e.value)
    assert "context_parallel_degree = 2" in msg and "sinks" in msg and "\n" not in msg


@pytest.mark.slow
@pytest.mark.timeout(600)  # 49 s in a quiet .ci/run, 53 beside 4 busy processes (147 once), its inductor cache cold
def test_gpt_oss_compiled_matches_eager(tmp_path, reference):
    """torch.compile of the blocks (two graphs: the windowed layers' and the full ones', the window a
    static attribute) vs eager, 1e-4 as the other compile tests (fused kernels reorder fp32 work).
    Validation off here: its no-grad forward is another graph per kind, ~20% more kernels to build
    (52 vs 43), and the compiled evaluation of an MoE model is tests/test_compiler.py's (ep2_moe)."""
    from test_compiler import assert_compiled
    p = run_cli(OSS + ["--training.local_batch_size=4", "--compile.enable=true", "--validation.enable=false"], tmp_path,
                timeout=300)
    assert_parity(reference, read_metrics(tmp_path), 1e-4, keys=("loss", "grad_norm"))
    assert "compiled 4 blocks" in p.stdout, p.stdout[-2000:]
    assert_compiled(p.stdout)


def test_optimizer_kinds_put_expert_biases_with_the_biases():
    """The experts' biases are 2-D ([experts, hidden]) but biases: AdamW without decay under Muon,
    never orthogonalised as matrices."""
    from torchmeg.train.optim import parameter_kinds
    m = _model()
    kinds = {k: {id(p) for p in ps} for k, ps in parameter_kinds(m, "output").items()}
    experts = m.layers["0"].moe.experts
    for name in ("b1", "b2", "b3"):
        assert id(getattr(experts, name)) in kinds["biases"], name
    assert id(experts.w1) in kinds["matrices"] and id(m.layers["0"].moe.router.bias) in kinds["biases"]
