"""LoRA ([lora]): adapters PEFT loads with the same logits (the outside reference), merged exports,
FSDP2 / TP2 / PP2 / TP2 x FSDP2 = one process, the optimizer holding the adapters only, the base
frozen, resume exact, SFT with LoRA, and `hf` models."""
from __future__ import annotations

import json
import os

import pytest
import torch

from conftest import FP32_PARITY, TINY, assert_parity, assert_resumed, assert_tensor_close, read_metrics, reference_run
from launch import ROOT, run_one, run_cli

# A learning rate at which the adapters move well away from zero within a few steps (B starts at 0).
# Every Linear of the blocks (not PEFT's default q and v): the colwise and rowwise TP roles both adapted.
LORA = TINY + ["--lora.enable=true", "--lora.rank=8", "--lora.alpha=16", "--lora.target_modules=['all-linear']",
               "--optimizer.lr=1e-2",
               "--training.steps=4", "--training.deterministic=true", "--training.global_batch_size=8",
               "--checkpoint.enable=true", "--checkpoint.interval=2", "--checkpoint.keep_latest_k=0"]
P = "--parallelism."
LAYOUTS = {
    "fsdp2": (2, 4, [P + "data_parallel_shard_degree=2"]),
    "tp2": (2, 8, [P + "tensor_parallel_degree=2", P + "data_parallel_shard_degree=1"]),
    "pp2": (2, 8, [P + "pipeline_parallel_degree=2", P + "data_parallel_shard_degree=1",
                   P + "pipeline_parallel_microbatches=4"]),
    "tp2_fsdp2": (4, 4, [P + "tensor_parallel_degree=2", P + "data_parallel_shard_degree=2"]),
}


def _checkpoint_tensors(step_dir) -> dict:
    """Every model tensor of a checkpoint (DCP, read without a process group)."""
    import torch.distributed.checkpoint as dcp
    meta = dcp.FileSystemReader(str(step_dir)).read_metadata().state_dict_metadata
    sd = {k: torch.empty(tuple(m.size), dtype=m.properties.dtype) for k, m in meta.items()
          if k.startswith("model.") and hasattr(m, "size")}
    dcp.load(sd, checkpoint_id=str(step_dir), no_dist=True)
    return sd, meta


@pytest.fixture(scope="module")
def lora_reference(tmp_path_factory):
    return reference_run(tmp_path_factory, LORA + ["--training.local_batch_size=8"])


@pytest.mark.slow
@pytest.mark.parametrize("name", list(LAYOUTS))
def test_lora_layout_matches_one_process(name, tmp_path, lora_reference):
    ranks, local, layout = LAYOUTS[name]
    run_cli(LORA + [f"--training.local_batch_size={local}"] + layout, tmp_path, nproc=ranks,
            env={"TORCHMEG_RECORD_OPS": str(tmp_path / "ops")})
    assert_parity(lora_reference, read_metrics(tmp_path))
    params = json.loads((tmp_path / "ops.rank0.json").read_text())["params"]
    if name == "tp2":  # the adapters follow their base's role (what ran, not only what it gave)
        assert params["layers.0.attention.wq_lora.A.weight"]["placements"] == ["Replicate"]
        assert params["layers.0.attention.wq_lora.B.weight"]["placements"] == ["Shard(0)"]
        assert params["layers.0.attention.wo_lora.A.weight"]["placements"] == ["Shard(1)"]
        assert params["layers.0.feed_forward.w2_lora.B.weight"]["placements"] == ["Replicate"]


@pytest.mark.slow
def test_lora_dropout_under_tp2_draws_one_processs_masks(tmp_path, lora_reference):
    """lora.dropout = 0.1 on every Linear: TP 2 = one process, step by step (the row-parallel bases'
    adapters see their input's columns; their noise is drawn whole and sliced, parallel.lora_dropout:
    drawn on the shard as before, 3.0e-2 off at step 1's grad norm), and dropout ran (the losses move
    away from the run without it)."""
    args = LORA + ["--training.local_batch_size=8", "--lora.dropout=0.1"]
    run_cli(args, tmp_path, name="one")
    run_cli(args + LAYOUTS["tp2"][2], tmp_path, nproc=2, name="tp2")
    one = read_metrics(tmp_path, "one")
    assert_parity(one, read_metrics(tmp_path, "tp2"))
    moved = [abs(a["loss"] - b["loss"]) / b["loss"] for a, b in zip(one, lora_reference)]
    assert max(moved) > 1e-3, moved


@pytest.mark.slow
def test_lora_compiled_and_in_bf16(tmp_path, lora_reference):
    """Compiled blocks with adapters = eager (1e-4: compiled kernels fuse and reorder floating-point
    work, tests/test_compiler.py's bound); bf16 under FSDP2: every matmul, the adapters' included, in
    bf16 (what ran), and the run learns."""
    p = run_cli(LORA + ["--training.local_batch_size=8", "--compile.enable=true"], tmp_path, name="compiled",
                timeout=300)
    assert "compiled 2 blocks" in p.stdout, p.stdout[:3000]
    assert_parity(lora_reference, read_metrics(tmp_path, "compiled"), 1e-4, keys=("loss",))  # (every step logged)
    run_cli(LORA + ["--training.local_batch_size=4", "--training.mixed_precision=bf16", "--training.steps=8",
                    P + "data_parallel_shard_degree=2"], tmp_path, nproc=2, name="bf16",
            env={"TORCHMEG_RECORD_OPS": str(tmp_path / "ops")})
    rec = json.loads((tmp_path / "ops.rank0.json").read_text())
    assert rec["matmul_dtypes"] and all(v == ["bfloat16"] for v in rec["matmul_dtypes"].values()), rec["matmul_dtypes"]
    rows = read_metrics(tmp_path, "bf16")
    assert rows[-1]["loss"] < rows[0]["loss"] - 0.3, rows


@pytest.mark.slow
def test_only_the_adapters_train_and_the_optimizer_holds_only_them(tmp_path):
    """Started from another run's weights: the base weights come out bit-identical, every adapter B
    moved away from zero, the optimizer's state is exactly two moments per adapter element, and a
    resumed run equals the uninterrupted one."""
    run_cli(TINY + ["--checkpoint.enable=true", "--training.steps=2"], tmp_path, name="src")
    src = tmp_path / "src" / "checkpoint"
    args = LORA + ["--training.local_batch_size=8", f"--checkpoint.initial_load_path={src}"]
    p = run_cli(args, tmp_path, name="ft")
    assert "lora       rank 8" in p.stdout and "the rest frozen" in p.stdout, p.stdout[:3000]
    start, _ = _checkpoint_tensors(src / "step-00000002")
    end, meta = _checkpoint_tensors(tmp_path / "ft" / "checkpoint" / "step-00000004")
    adapters = {k: v for k, v in end.items() if "_lora." in k}
    assert len(adapters) == 2 * 7 * 2  # A and B beside wq wk wv wo w1 w2 w3 of 2 layers
    for k, v in start.items():
        assert torch.equal(v, end[k]), k  # frozen
    assert all(v.abs().max() > 1e-3 for k, v in adapters.items() if k.endswith("B.weight"))
    moments = sum(m.size.numel() for k, m in meta.items() if k.startswith("optimizer.state.")
                  and k.endswith(("exp_avg", "exp_avg_sq")))
    assert moments == 2 * sum(v.numel() for v in adapters.values())
    # resumed from step 2 = the uninterrupted run (the adapters and their moments restored)
    run_cli(args + ["--training.steps=2"], tmp_path, name="re")
    assert_resumed(run_cli(args, tmp_path, name="re"), 2)
    assert_parity(read_metrics(tmp_path, "ft")[-2:], read_metrics(tmp_path, "re")[-2:], steps={3, 4})


@pytest.mark.slow
def test_peft_loads_the_adapters_with_torchmegs_logits(tmp_path):
    """A LoRA run of a native Llama (q and k rows in torchmeg's RoPE order) -> to-hf: the base folder
    plus a PEFT adapter folder that peft loads onto it with torchmeg's logits; --merge-lora gives the
    same logits as plain weights; the base alone does not."""
    import sys
    import torch.distributed.checkpoint as dcp
    from peft import PeftModel
    from transformers import AutoModelForCausalLM
    from torchmeg.config.schema import load_config
    from torchmeg.models import build_model
    from torchmeg.train.build import add_adapters
    args = LORA + ["--training.local_batch_size=8", "--training.steps=8", "--lr_scheduler.warmup_steps=1"]
    run_cli(args, tmp_path)
    ckpt = tmp_path / "run" / "checkpoint"
    recipe = tmp_path / "recipe.toml"
    recipe.write_text('[lora]\nenable = true\nrank = 8\nalpha = 16.0\ntarget_modules = ["all-linear"]\n'
                      '[model]\ndim = 64\nn_layers = 2\nn_heads = 4\nn_kv_heads = 2\nmultiple_of = 64\n')
    for out, extra in (("hf", []), ("merged", ["--merge-lora"])):
        p = run_one([sys.executable, "-m", "torchmeg.convert", "to-hf", str(ckpt), "--config", str(recipe),
                      "--out", str(tmp_path / out)] + extra, dict(os.environ), 120)
        assert p.returncode == 0, p.stderr[-3000:]
    assert json.loads((tmp_path / "hf" / "adapter" / "adapter_config.json").read_text())["r"] == 8
    # generating from the checkpoint without [lora] would run the base alone, and with PEFT's default
    # targets (q and v) without the other adapters it trained: each refused in one line
    for lora, said in (([], "lora.enable = true"), (["--lora.enable=true"], "lora.target_modules = []")):
        p = run_one([sys.executable, "-m", "torchmeg.generate", "--config", "recipes/debug_llama.toml",
                     f"--job.dump_folder={tmp_path}", "--job.name=run", "--prompt", "x", "--max-new-tokens", "2"]
                    + [a for a in TINY if a.startswith("--model.")] + lora, dict(os.environ), 120)
        assert p.returncode == 2 and said in p.stderr.strip().splitlines()[-1], p.stderr[-2000:]
    assert not os.path.exists(tmp_path / "merged" / "adapter")
    cfg = load_config(str(recipe), [])
    ours = build_model(cfg, 257, "cpu")
    add_adapters(ours, cfg)
    sd = {"model": ours.state_dict()}
    dcp.load(sd, checkpoint_id=str(ckpt / "step-00000008"), no_dist=True)
    ours.load_state_dict(sd["model"])
    x = torch.randint(0, 257, (2, 40), generator=torch.Generator().manual_seed(3))
    load = lambda f: AutoModelForCausalLM.from_pretrained(str(tmp_path / f)).eval()  # noqa: E731
    with torch.no_grad():
        want = ours.eval()(x)
        peft = PeftModel.from_pretrained(load("hf"), str(tmp_path / "hf" / "adapter")).eval()
        assert_tensor_close(peft(x).logits, want, FP32_PARITY, "peft's logits vs torchmeg's")
        assert_tensor_close(load("merged")(x).logits, want, FP32_PARITY, "merged logits vs torchmeg's")
        base = load("hf")(x).logits
        assert (base - want).abs().max() > 100 * FP32_PARITY * want.abs().max()  # the adapters matter


@pytest.mark.slow
def test_lora_on_a_transformers_folder_trains_in_every_layout_and_exports_for_peft(tmp_path):
    """model.name = "hf" + [lora] + checkpoint.initial_load_hf (a folder transformers wrote: the
    adapters start at B = 0 beside the loaded base): TP2 = one process, FSDP2 resumed from one process's
    step-3 checkpoint = its steps 4-6, the exported base is the folder's tensors bit for bit, and the
    adapter loads in peft with torchmeg's logits of the run's last checkpoint."""
    import shutil
    import torch.distributed.checkpoint as dcp
    from peft import PeftModel
    from safetensors.torch import load_file
    from transformers import AutoConfig, AutoModelForCausalLM
    from torchmeg.config.schema import load_config
    from torchmeg.models import build_model
    from torchmeg.train.build import add_adapters
    hf_cfg = json.load(open(os.path.join(ROOT, "recipes/hf/llama_debug.json")))
    torch.manual_seed(1)
    AutoModelForCausalLM.from_config(AutoConfig.for_model(**hf_cfg)).save_pretrained(str(tmp_path / "start"))
    common = ["--config", "recipes/hf_llama_debug.toml", "--lora.enable=true", "--lora.rank=4", "--lora.alpha=8",
              "--lora.target_modules=['model.layers.*.self_attn.q_proj', 'model.layers.*.mlp.down_proj']",
              "--training.steps=6", "--optimizer.lr=1e-2", "--lr_scheduler.warmup_steps=1", "--data.seq_len=64",
              "--training.local_batch_size=4", "--validation.enable=false", "--metrics.enable_tensorboard=false",
              "--checkpoint.enable=true", "--checkpoint.interval=3", "--training.deterministic=true", "--metrics.log_freq=1",
              f"--checkpoint.initial_load_hf={tmp_path / 'start'}"]
    p = run_cli(common + ["--checkpoint.export_hf=true"], tmp_path, name="one")
    assert "8 adapters on model.layers.*.self_attn.q_proj" in p.stdout, p.stdout[:3000]
    assert f"init       from Hugging Face weights in {tmp_path / 'start'}" in p.stdout, p.stdout[:3000]
    one = read_metrics(tmp_path, "one")
    run_cli(common + [P + "tensor_parallel_degree=2"], tmp_path, nproc=2, name="tp")
    assert_parity(one, read_metrics(tmp_path, "tp"), keys=("loss", "grad_norm"))
    shutil.copytree(tmp_path / "one" / "checkpoint" / "step-00000003", tmp_path / "fsdp" / "checkpoint" / "step-00000003")
    p = run_cli(common + [P + "data_parallel_shard_degree=2", "--training.local_batch_size=2"], tmp_path, nproc=2,
                name="fsdp")
    assert_resumed(p, 3)
    assert_parity(one[3:], read_metrics(tmp_path, "fsdp"), keys=("loss", "grad_norm"))
    hf = tmp_path / "one" / "checkpoint" / "hf"
    base, start = load_file(str(hf / "model.safetensors")), load_file(str(tmp_path / "start" / "model.safetensors"))
    assert sorted(base) == sorted(start) and all(torch.equal(base[k], start[k]) for k in start)  # frozen, exact
    config = json.loads((hf / "adapter" / "adapter_config.json").read_text())
    assert sorted(config["target_modules"])[:2] == ["model.layers.0.mlp.down_proj", "model.layers.0.self_attn.q_proj"]
    cfg = load_config(os.path.join(ROOT, "recipes/hf_llama_debug.toml"), [a for a in common[2:] if a.startswith("--lora")])
    ours = build_model(cfg, 257, "cpu")
    add_adapters(ours, cfg)
    sd = {"model": ours.state_dict()}
    dcp.load(sd, checkpoint_id=str(tmp_path / "one" / "checkpoint" / "step-00000006"), no_dist=True)
    ours.load_state_dict(sd["model"])
    x = torch.randint(0, 257, (2, 32), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        want = ours.eval()(x)
        want = want.logits if hasattr(want, "logits") else want
        peft = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(str(hf)), str(hf / "adapter")).eval()
        assert_tensor_close(peft(x).logits, want, FP32_PARITY, "peft's logits vs torchmeg's")
        base_logits = AutoModelForCausalLM.from_pretrained(str(hf))(x).logits
        assert (base_logits - want).abs().max() > 100 * FP32_PARITY * want.abs().max()  # the adapters matter


FAMILIES = {  # model args -> the Linear names all-linear must adapt in block 0
    "llama": (["--config", "recipes/debug_llama.toml"], ["attention.wq", "feed_forward.w2"]),
    "gpt2": (["--config", "recipes/gpt2_124m.toml", "--model.flavor=debug"], None),
    "moe": (["--config", "recipes/moe_debug.toml"], ["attention.wo"]),
    "deepseek_v3": (["--config", "recipes/deepseek_v3_debug.toml"], ["attention.wkv_b"]),
    "hf": (["--config", "recipes/hf_llama_debug.toml"], ["self_attn.q_proj", "mlp.down_proj"]),
}


@pytest.mark.slow
@pytest.mark.parametrize("family", list(FAMILIES))
def test_every_family_takes_adapters_and_learns_through_them(family, tmp_path):
    """all-linear on each family: the adapters exist where expected (never on MoE routers or the
    grouped experts), and 6 steps through them lower the validation loss below that of the same run
    at lr 0 (the base alone)."""
    args, expect = FAMILIES[family]
    # global batch 4: gpt2_124m's recipe accumulates to 512 sequences a step (768 microbatches in 6 steps)
    args = args + ["--lora.enable=true", "--lora.target_modules=['all-linear']", "--training.steps=6", "--data.seq_len=64", "--training.local_batch_size=4",
                   "--training.global_batch_size=4",
                   "--lr_scheduler.warmup_steps=1", "--lr_scheduler.decay_type=constant", "--validation.enable=true",
                   "--validation.freq=6", "--validation.steps=2", "--metrics.log_freq=1",
                   "--metrics.enable_tensorboard=false", "--checkpoint.enable=false", "--checkpoint.export_hf=false",
                   "--parallelism.pipeline_parallel_degree=1", "--parallelism.expert_parallel_degree=1",
                   "--compile.enable=false"]
    run_cli(args + ["--optimizer.lr=5e-3"], tmp_path, env={"TORCHMEG_RECORD_OPS": str(tmp_path / "ops")}, timeout=240)
    run_cli(args + ["--optimizer.lr=0"], tmp_path, name="base", timeout=240)
    params = json.loads((tmp_path / "ops.rank0.json").read_text())["params"]
    adapted = sorted({k.split("_lora.")[0] for k in params if "_lora." in k})
    assert adapted and not any(k.endswith(("router", "gate", "experts")) for k in adapted), adapted
    if expect:
        assert all(any(a.endswith(f".0.{e}") for a in adapted) for e in expect), adapted
    trained, base = read_metrics(tmp_path)[-1]["val_loss"], read_metrics(tmp_path, "base")[-1]["val_loss"]
    assert trained < base - 0.05, (trained, base)


def test_adapters_off_is_the_base_model_and_copies_nothing():
    """models.lora.adapters_off (GRPO's reference under LoRA, as PEFT's disable_adapter): with trained
    (non-zero) adapters, the forward inside the block is the base model's bit for bit, the adapted one's
    after; no parameter is copied or changed."""
    import torch
    from torch import nn

    from torchmeg.models.lora import adapters_off, attach
    class MLP(nn.Module):
        def __init__(self):
            super().__init__()
            self.up, self.down = nn.Linear(8, 16), nn.Linear(16, 4)

        def forward(self, x):
            return self.down(torch.relu(self.up(x)))
    torch.manual_seed(0)
    model = MLP()
    x = torch.randn(3, 8)
    base = model(x)
    attach(model, ["up", "down"], rank=2, alpha=4.0, dropout=0.0)
    for m in model.modules():
        if hasattr(m, "B") and isinstance(m.B, nn.Linear):
            nn.init.normal_(m.B.weight)  # trained adapters: their update is not zero
    adapted = model(x)
    before = [p.detach().clone() for p in model.parameters()]
    with adapters_off(model):
        off = model(x)
    assert torch.equal(off, base) and not torch.allclose(adapted, base)
    assert torch.equal(model(x), adapted)
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))
