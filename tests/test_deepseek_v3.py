"""DeepSeek-V3 natively: MLA's latent cache equals recomputation, group-limited routing selects as
DeepSeek-V3 defines it, the MTP loss trains the shared embedding (and only when on), and every
layout equals one process (the parity rule). transformers' logits and tokens: tests/test_convert.py."""
import pytest
import torch

from conftest import BF16_U, FP32_PARITY, assert_parity, assert_tensor_close, read_metrics, reference_run
from launch import run_cli
from torchmeg.config.schema import ConfigError, load_config
from torchmeg.models import build_model, init_weights
from torchmeg.models.kv_cache import KVCache
from torchmeg.models.moe import limit_to_groups
from torchmeg.train.validate import validate
from test_compiler import assert_compiled

P = "--parallelism."
DS = ["--config", "recipes/deepseek_v3_debug.toml", "--data.seq_len=32", "--training.steps=4",
      "--training.deterministic=true", "--training.global_batch_size=8", "--lr_scheduler.warmup_steps=2",
      "--metrics.log_freq=1", "--metrics.enable_tensorboard=false", "--validation.enable=true", "--validation.steps=2",
      "--validation.freq=4"]


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
    # MTP on the last stage reads the first stage's embedding of the tokens ahead, passed down the
    # pipeline; ZBV puts the first and last stage on one rank and splits the backward in two.
    # (under PP the MoE balancing counts no tokens of torch's shape-inference forward: see pipeline.py)
    ("pp2_uneven_3_1", 2, 8, [P + "pipeline_parallel_degree=2", P + "pipeline_parallel_microbatches=4",
                              P + "pipeline_parallel_layers_per_stage=[3, 1]"]),
    ("pp2_zbv_accum2", 2, 4, [P + "pipeline_parallel_degree=2", P + "pipeline_parallel_schedule=ZBVZeroBubble",
                              P + "pipeline_parallel_layers_per_stage=1"]),
    # the last stage's main and MTP losses on vocab-sharded logits (loss parallel under PP)
    ("pp2_tp2", 4, 8, [P + "pipeline_parallel_degree=2", P + "tensor_parallel_degree=2", P + "data_parallel_shard_degree=1",
                       P + "pipeline_parallel_microbatches=4", P + "pipeline_parallel_layers_per_stage=[3, 1]"]),
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


# The sequence-wise balance loss 1000x the debug flavor's, so that a shard computing it from its
# own half of each sequence moves the step-4 loss by 3e-3 (measured), not within the parity bound.
STRONG_SEQ_AUX = ["--model.seq_aux_loss_coef=0.1"]


@pytest.fixture(scope="module")
def reference_strong_seq_aux(tmp_path_factory):
    return reference_run(tmp_path_factory, DS + STRONG_SEQ_AUX + ["--training.local_batch_size=8"])


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["allgather", "ring", "alltoall"])
def test_deepseek_v3_cp_matches_single_process(mode, tmp_path, reference_strong_seq_aux):
    """MLA under each CP mode (its value head, 32, narrower than query/key, 48: the flash kernels
    take it padded); MTP, whose tokens ahead cross the shards' ends and whose ignored tail lies on
    one shard (both taken from the whole sequences before sharding); the sequence-wise balance loss,
    from the whole sequences' counts and scores (summed over the shards)."""
    run_cli(DS + STRONG_SEQ_AUX + ["--training.local_batch_size=8", P + "context_parallel_degree=2",
                                   P + f"context_parallel_mode={mode}"], tmp_path, nproc=2)
    assert_parity(reference_strong_seq_aux, read_metrics(tmp_path), keys=("loss", "grad_norm", "val_loss", "mtp_loss"))


@pytest.mark.slow
@pytest.mark.timeout(600)  # 50 s in a quiet .ci/run, 62 beside 4 busy processes (103 once), its inductor cache cold
def test_deepseek_v3_compiled_matches_eager(tmp_path, reference):
    """torch.compile of the MLA + MoE blocks (fp32 on CPU: the routed experts leave the graph for
    the expert loop, grouped matmuls being bf16-only under compile) vs eager, 1e-4 as the other
    compile tests (fused kernels reorder fp32 work). Validation off, as in tests/test_gpt_oss.py's
    compiled test: its no-grad graphs would be a fifth more kernels to build."""
    p = run_cli(DS + ["--training.local_batch_size=8", "--compile.enable=true", "--validation.enable=false"], tmp_path,
                timeout=300)
    assert_parity(reference, read_metrics(tmp_path), 1e-4, keys=("loss", "grad_norm", "mtp_loss"))
    assert "compiled 4 blocks" in p.stdout, p.stdout[-2000:]
    assert_compiled(p.stdout)  # and compiled code ran


@pytest.mark.parametrize("override, world, words", [
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
    casts by one e4m3 ulp (2^-3); a norm moves <= 2^-3 sqrt(p) ~ 2e-3 a step, 4 steps < 1e-2.
    Unlike a dense model, routing is discrete: a router near-tie that one such ulp flips sends a token
    to another expert from step 2 on (measured: experts max/mean 2.19 vs 2.17 at step 2), and the
    grad norm after the step-3 update then moves by up to 4% (measured), the trajectory's chaos, not
    the layout's. So, as the bf16 tests do: the loss at every step, the grad norm at step 1 (same
    weights in both runs)."""
    import json
    f8 = DS + ["--model.mtp_depth=0", "--model.seq_aux_loss_coef=0", "--float8.enable=true"]
    run_cli(f8 + ["--training.local_batch_size=8"], tmp_path, name="one")
    run_cli(f8 + ["--training.local_batch_size=8", P + "tensor_parallel_degree=2", P + "data_parallel_shard_degree=1"],
            tmp_path, nproc=2, name="tp", env={"TORCHMEG_RECORD_OPS": str(tmp_path / "ops")})
    rec = json.loads((tmp_path / "ops.rank0.json").read_text())
    converted = set(rec["float8_modules"])
    for fqn in ("layers.1.attention.wq_b", "layers.1.attention.wkv_b", "layers.1.attention.wo",
                "layers.0.feed_forward.w1", "layers.1.moe.shared.w2"):
        assert fqn in converted, sorted(converted)
    assert "float8_e4m3fn" in rec["dtypes_seen"], rec["dtypes_seen"]
    one, tp = read_metrics(tmp_path, "one"), read_metrics(tmp_path, "tp")
    assert_parity(one, tp, 1e-2, keys=("loss", "val_loss"))
    assert_parity(one, tp, 1e-2, keys=("grad_norm",), steps=[1])


@pytest.mark.slow
def test_deepseek_v3_bf16_layouts_match_bf16_one_process(tmp_path, reference):
    """bf16 compute (FSDP2's mixed precision), fp32 master weights, MTP and every routing option on:
    FSDP2, EP2 and PP2 vs one process, with the bf16 bounds of tests/test_parallel.py (the loss within
    u = 2^-8 at every step, the step-1 grad norm within 2u; later grad norms are the trajectory's
    chaos). Asserts what ran: every matmul, attention and grouped expert matmul operand is bf16 on
    every rank, and the bf16 run is not the fp32 one."""
    import json
    bf16 = DS + ["--training.mixed_precision=bf16"]
    layouts = {"one": (1, ["--training.local_batch_size=8"]),
               "fsdp2": (2, ["--training.local_batch_size=4"]),
               "ep2": (2, ["--training.local_batch_size=4", P + "expert_parallel_degree=2"]),
               "pp2": (2, ["--training.local_batch_size=8", P + "pipeline_parallel_degree=2",
                           P + "pipeline_parallel_microbatches=4"])}
    for name, (n, layout) in layouts.items():
        run_cli(bf16 + layout, tmp_path, name=name, nproc=n, env={"TORCHMEG_RECORD_OPS": str(tmp_path / f"{name}_ops")})
        for rank in range(n):
            mm = json.loads((tmp_path / f"{name}_ops.rank{rank}.json").read_text())["matmul_dtypes"]
            assert all(v == ["bfloat16"] for v in mm.values()), (name, rank, mm)
            if name != "pp2":  # (each pipeline rank runs half the layers: the union is checked below)
                assert {"mm", "_grouped_mm"} <= set(mm) and any("attention" in k for k in mm), (name, rank, mm)
    pp_ops = set().union(*(json.loads((tmp_path / f"pp2_ops.rank{r}.json").read_text())["matmul_dtypes"] for r in (0, 1)))
    assert {"mm", "_grouped_mm"} <= pp_ops and any("attention" in k for k in pp_ops), pp_ops
    one = read_metrics(tmp_path, "one")
    assert [r["loss"] for r in one] != [r["loss"] for r in reference], "bf16 run equals the fp32 run"
    for name in ("fsdp2", "ep2", "pp2"):
        got = read_metrics(tmp_path, name)
        assert_parity(one, got, BF16_U, keys=("loss", "val_loss", "mtp_loss"))
        assert_parity(one, got, 2 * BF16_U, keys=("grad_norm",), steps=[1])
