"""DeepSeek-V3 natively: MLA's latent cache equals recomputation, group-limited routing selects as
DeepSeek-V3 defines it, the MTP loss trains the shared embedding (and only when on), and every
layout equals one process (the parity rule). transformers' logits and tokens: tests/test_convert.py."""
import pytest
import torch

from conftest import FP32_PARITY, assert_parity, assert_tensor_close, read_metrics, reference_run, run_cli
from torchmeg.config.schema import ConfigError, load_config
from torchmeg.models import build_model, init_weights
from torchmeg.models.kv_cache import KVCache
from torchmeg.models.moe import limit_to_groups
from torchmeg.train.validate import validate
from test_compiler import assert_compiled

P = "--parallelism."
DS = ["--config", "recipes/deepseek_v3_debug.toml", "--data.seq_len=32", "--training.steps=4",
      "--training.deterministic=true", "--training.global_batch_size=8", "--lr_scheduler.warmup_steps=2",
      "--metrics.log_freq=1", "--metrics.enable_tensorboard=false", "--validation.steps=2", "--validation.freq=4"]


def _model(**over):
    cfg = load_config(None, ["--model.name=deepseek_v3", "--model.flavor=debug"] +
                      [f"--model.{k}={v}" for k, v in over.items()])
    m = build_model(cfg, 257, "cpu")
    init_weights(m, seed=0)
    return m


def test_latent_cache_decode_equals_recompute():
    """Prefill then one token at a time through the cache of [latent ; rotary key] (absorbed
    projections) gives the logits of a full forward at every position."""
    m = _model().eval()
    x = torch.randint(0, 257, (2, 24), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        full = m(x)
        cache = KVCache(2, 32)
        pos = cache.positions(16)
        got = [m(x[:, :16], positions=pos, cache=cache)]
        cache.advance(16)
        for i in range(16, 24):
            got.append(m(x[:, i:i + 1], positions=cache.positions(1), cache=cache))
            cache.advance(1)
    assert_tensor_close(torch.cat(got, 1), full, FP32_PARITY, "cached decode vs recompute")
    layer = cache.layers["1"]
    a = m.args
    assert layer.v is None and layer.k.shape == (2, 1, 32, a.kv_lora_rank + a.qk_rope_head_dim)  # latent only


def test_group_limited_routing_picks_from_the_best_groups():
    """Scores of 8 experts in 4 groups: each group scored by its two best; with 2 groups kept, the
    top-2 comes from those groups even where a lone high score sits in another group."""
    s = torch.tensor([[0.6, 0.0, 0.5, 0.45, 0.4, 0.4, 0.7, 0.0]])
    assert s.topk(2).indices.sort().values.tolist() == [[0, 6]]  # without groups
    kept = limit_to_groups(s, 4, 2)  # group sums 0.6, 0.95, 0.8, 0.7 -> groups 1 and 2
    assert kept.topk(2).indices.sort().values.tolist() == [[2, 3]]
    assert torch.isinf(kept[0, [0, 1, 6, 7]]).all() and not torch.isinf(kept[0, 2:6]).any()


def test_mtp_loss_reaches_the_shared_embedding_only_when_on():
    """The MTP modules' loss trains the shared embedding: with the main loss cut off, its gradient
    is non-zero with MTP on and zero with model.mtp_depth = 0."""
    x = torch.randint(0, 257, (2, 32), generator=torch.Generator().manual_seed(0))
    grads = {}
    for depth in (1, 0):
        m = _model(mtp_depth=depth, seq_aux_loss_coef=0).train()  # (the balance loss reaches it too)
        out = m(x, labels=x.roll(-1, 1))
        (out * 0).sum().backward()  # only what MTP adds reaches the parameters
        grads[depth] = m.tok_embeddings.weight.grad
        if depth:
            assert m.mtp_loss.item() > 0
    assert grads[1] is not None and grads[1].abs().sum() > 0
    assert grads[0] is None or grads[0].abs().sum() == 0


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    return reference_run(tmp_path_factory, DS + ["--training.local_batch_size=8"])


# Each layout vs one process, fp32, the parity rule. MTP, the sequence-wise loss, group-limited
# routing and the latent projections are on in every one that takes them (the debug flavor).
LAYOUTS = [
    ("recompute_selective", 1, 8, ["--activation_checkpoint.mode=selective"]),
    ("fsdp2", 2, 4, []),
    ("hsdp_2x2", 4, 2, [P + "data_parallel_replicate_degree=2"]),
    ("tp2", 2, 8, [P + "tensor_parallel_degree=2", P + "data_parallel_shard_degree=1"]),
    ("ep2_fsdp2", 2, 4, [P + "expert_parallel_degree=2"]),
    ("tp2_ep2_fsdp2", 4, 4, [P + "tensor_parallel_degree=2", P + "expert_parallel_degree=2"]),
]


@pytest.mark.slow
@pytest.mark.parametrize("name, ranks, local, layout", LAYOUTS, ids=[x[0] for x in LAYOUTS])
def test_deepseek_v3_layouts_match_single_process(name, ranks, local, layout, tmp_path, reference):
    p = run_cli(DS + [f"--training.local_batch_size={local}"] + layout, tmp_path, nproc=ranks)
    got = read_metrics(tmp_path)
    assert_parity(reference, got, keys=("loss", "grad_norm", "val_loss", "mtp_loss"))
    for a, b in zip(reference, got):
        assert a["tokens_per_expert"] == b["tokens_per_expert"]  # the same routing, globally
    assert "mtp_loss" in p.stdout


# Without MTP and the sequence-wise loss, which these layouts refuse (see below).
NO_MTP = ["--model.mtp_depth=0", "--model.seq_aux_loss_coef=0"]


@pytest.fixture(scope="module")
def reference_no_mtp(tmp_path_factory):
    return reference_run(tmp_path_factory, DS + NO_MTP + ["--training.local_batch_size=8"])


@pytest.mark.slow
@pytest.mark.parametrize("name, ranks, local, layout", [
    # (under PP the MoE balancing counts no tokens of torch's shape-inference forward: see pipeline.py)
    ("pp2", 2, 8, [P + "pipeline_parallel_degree=2", P + "pipeline_parallel_microbatches=4"]),
    # MLA's value head (24) is narrower than its query/key head (48): CP's flash kernels take it padded
] + [(f"cp2_{mode}", 2, 8, [P + "context_parallel_degree=2", P + f"context_parallel_mode={mode}"])
     for mode in ("allgather", "ring", "alltoall")], ids=["pp2", "cp2_allgather", "cp2_ring", "cp2_alltoall"])
def test_deepseek_v3_pp_and_cp_match_single_process(name, ranks, local, layout, tmp_path, reference_no_mtp):
    run_cli(DS + NO_MTP + [f"--training.local_batch_size={local}"] + layout, tmp_path, nproc=ranks)
    assert_parity(reference_no_mtp, read_metrics(tmp_path))


@pytest.mark.slow
def test_deepseek_v3_compiled_matches_eager(tmp_path, reference):
    """torch.compile of the MLA + MoE blocks (fp32 on CPU: the routed experts leave the graph for
    the expert loop, grouped matmuls being bf16-only under compile) vs eager, 1e-4 as the other
    compile tests (fused kernels reorder fp32 work)."""
    p = run_cli(DS + ["--training.local_batch_size=8", "--compile.enable=true"], tmp_path, timeout=300)
    assert_parity(reference, read_metrics(tmp_path), 1e-4, keys=("loss", "grad_norm", "val_loss", "mtp_loss"))
    assert "compiled 4 blocks" in p.stdout, p.stdout[-2000:]
    assert_compiled(p.stdout)  # and compiled code ran


@pytest.mark.parametrize("override, world, words", [
    ([P + "pipeline_parallel_degree=2"], 2, ["model.mtp_depth = 1", "pipeline_parallel_degree = 2"]),
    ([P + "context_parallel_degree=2", "--model.mtp_depth=0"], 2, ["model.seq_aux_loss_coef", "whole sequences"]),
    (["--model.topk_groups=5"], 1, ["model.topk_groups = 5", "n_expert_groups = 4"]),
    (["--model.n_expert_groups=3"], 1, ["model.n_expert_groups = 3", "n_experts = 8"]),
])
def test_layouts_and_routing_it_cannot_take_are_refused(override, world, words):
    cfg = load_config("recipes/deepseek_v3_debug.toml", override)
    with pytest.raises(ConfigError) as e:
        validate(cfg, world_size=world)
    for w in words:
        assert w in str(e.value), str(e.value)


@pytest.mark.slow
def test_deepseek_v3_float8_tp2_matches_float8_one_process(tmp_path):
    """torchao float8 (emulated on CPU) on MLA's and the dense / shared-expert projections, TP2 vs one
    process. Bound 1e-2 as the llama float8 TP test (tests/test_compiler.py): a sharded matmul sums
    in another order (~n 2^-24 relative, n <= 256 here), moving a fraction ~n 2^-24 / 2^-4 of the e4m3
    casts by one e4m3 ulp (2^-3); a norm moves <= 2^-3 sqrt(p) ~ 2e-3 a step, 4 steps < 1e-2."""
    import json
    f8 = DS + NO_MTP + ["--float8.enable=true"]
    run_cli(f8 + ["--training.local_batch_size=8"], tmp_path, name="one")
    run_cli(f8 + ["--training.local_batch_size=8", P + "tensor_parallel_degree=2", P + "data_parallel_shard_degree=1"],
            tmp_path, nproc=2, name="tp", env={"TORCHMEG_RECORD_OPS": str(tmp_path / "ops")})
    rec = json.loads((tmp_path / "ops.rank0.json").read_text())
    converted = set(rec["float8_modules"])
    for fqn in ("layers.1.attention.wq_b", "layers.1.attention.wkv_b", "layers.1.attention.wo",
                "layers.0.feed_forward.w1", "layers.1.moe.shared.w2"):
        assert fqn in converted, sorted(converted)
    assert "float8_e4m3fn" in rec["dtypes_seen"], rec["dtypes_seen"]
    assert_parity(read_metrics(tmp_path, "one"), read_metrics(tmp_path, "tp"), 1e-2)
