"""Every class of bad input: exit 2, exactly one line on stderr naming the key, no traceback."""
import os
import re
import subprocess
import sys

import pytest

from torchmeg.config.schema import ConfigError, load_config
from torchmeg.train.validate import validate
from torchmeg.train.cli import main

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RECIPE = os.path.join(ROOT, "recipes", "debug_llama.toml")


def _fails(capsys, argv, *must_contain):
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1, err
    assert "Traceback" not in err
    for s in must_contain:
        assert s in err, err
    return err


@pytest.mark.parametrize("override, words", [
    ("--training.stpes=5", ["training.stpes", "did you mean 'steps'"]),
    ("--trainig.steps=5", ["trainig", "did you mean 'training'"]),
    ("--training.steps=abc", ["training.steps", "'abc'", "integer"]),
    ("--training.local_batch_size=0", ["training.local_batch_size", "0", ">= 1"]),
    ("--training.mixed_precision=fp8", ["training.mixed_precision", "'fp8'", "fp32, bf16"]),
    ("--lr_scheduler.decay_type=cosin", ["lr_scheduler.decay_type", "cosine"]),
    ("--training.global_batch_size=12", ["training.global_batch_size", "12", "multiple"]),
    ("--model.n_heads=7", ["model", "n_heads", "7"]),
    ("--model.dimm=64", ["model.dimm", "did you mean 'dim'"]),
    ("--model.name=lama", ["model.name", "'lama'", "llama"]),
    ("--model.flavor=9B", ["model.flavor", "'9B'", "8B"]),
    ("--data.dataset=/nonexistent/corpus", ["data.dataset", "/nonexistent/corpus", "preprocess_data"]),
    ("--data.tokenizer=/nonexistent/tok.json", ["data.tokenizer", "/nonexistent/tok.json", "byte"]),
    ("--data.seq_len=100000", ["data.seq_len", "100000", "max_seq_len"]),
    (["--checkpoint.export_hf=true", "--checkpoint.enable=false"], ["checkpoint.export_hf", "checkpoint.enable = true"]),
    ("--optimizer.betas=[0.9]", ["optimizer.betas", "two numbers"]),
    ("--data.weights=[1.0, 2.0]", ["data.weights", "one per"]),
])
def test_bad_override(capsys, override, words):
    _fails(capsys, ["--config", RECIPE] + (override if isinstance(override, list) else [override]), *words)


def test_bad_toml_names_line(tmp_path, capsys):
    bad = tmp_path / "bad.toml"
    bad.write_text("[training]\nsteps = 10\nlocal_batch_size = = 3\n")
    err = _fails(capsys, ["--config", str(bad)], "bad.toml", "invalid TOML", "line 3")
    assert "local_batch_size" not in err or "line 3" in err


def test_unknown_section_in_file(tmp_path, capsys):
    bad = tmp_path / "bad.toml"
    bad.write_text("[trainng]\nsteps = 10\n")
    _fails(capsys, ["--config", str(bad)], "[trainng]", "did you mean 'training'")


def test_wrong_type_in_file(tmp_path, capsys):
    bad = tmp_path / "bad.toml"
    bad.write_text('[training]\nsteps = "ten"\n')
    _fails(capsys, ["--config", str(bad)], "training.steps", "'ten'", "integer")


def test_missing_recipe(capsys):
    _fails(capsys, ["--config", "/nonexistent.toml"], "/nonexistent.toml", "no such file")


def test_world_size_mismatch():
    cfg = load_config(RECIPE, ["--parallelism.tensor_parallel_degree=4", "--parallelism.data_parallel_shard_degree=1"])
    with pytest.raises(ConfigError, match="world size is 2"):
        validate(cfg, world_size=2)
    cfg = load_config(RECIPE, ["--parallelism.tensor_parallel_degree=3"])
    with pytest.raises(ConfigError, match="does not divide the world size 4"):
        validate(cfg, world_size=4)


def test_tp_must_divide_heads():
    cfg = load_config(RECIPE, ["--parallelism.tensor_parallel_degree=3", "--parallelism.data_parallel_shard_degree=1"])
    with pytest.raises(ConfigError, match="tensor_parallel_degree = 3: does not divide model.n_heads = 8"):
        validate(cfg, world_size=3)


def test_overrides_are_typed():
    cfg = load_config(RECIPE, ["--compile.components=[\"model\"]", "--optimizer.lr", "1e-4", "--job.name=123",
                               "--training.deterministic=true", "--model.n_layers=2",
                               "--activation_checkpoint.selective_option=2"])
    assert cfg.compile.components == ["model"] and cfg.optimizer.lr == 1e-4 and cfg.job.name == "123"
    assert cfg.training.deterministic is True and cfg.model.overrides == {"n_layers": 2}
    assert cfg.activation_checkpoint.selective_option == 2
    validate(cfg, world_size=1)


@pytest.mark.slow
def test_cli_exit_code_and_no_traceback():
    p = subprocess.run([sys.executable, "-m", "torchmeg.train", "--config", RECIPE, "--training.steps=-3"],
                       capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert p.returncode == 2
    lines = [ln for ln in p.stderr.strip().splitlines() if ln]
    assert lines == [lines[0]] and "training.steps" in lines[0] and "-3" in lines[0], p.stderr
    assert p.stdout == ""


def test_cuda_requested_without_cuda(capsys):
    import torch
    argv = ["--config", RECIPE, "--training.device=cuda", "--training.steps=1"]
    if torch.cuda.is_available():
        validate(load_config(RECIPE, argv[2:]), world_size=1)
    else:
        _fails(capsys, argv, "training.device", "cuda", "auto")


def test_tf32_is_set_on_cuda_only():
    """training.tf32 sets torch's TF32 flags for a CUDA device (global flags: no CUDA call, so this
    runs on a CPU-only build) and leaves a CPU run's as they are."""
    import torch
    from torchmeg.runtime.process import set_matmul_precision
    saved = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    try:
        for tf32 in (True, False):
            cfg = load_config(None, [f"--training.tf32={str(tf32).lower()}"])
            torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = not tf32
            set_matmul_precision(cfg, torch.device("cpu"))
            assert torch.backends.cuda.matmul.allow_tf32 is (not tf32)
            set_matmul_precision(cfg, torch.device("cuda"))
            assert torch.backends.cuda.matmul.allow_tf32 is tf32 and torch.backends.cudnn.allow_tf32 is tf32
    finally:
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = saved


@pytest.mark.parametrize("args, words", [
    (["--parallelism.pipeline_parallel_degree=2", "--parallelism.pipeline_parallel_schedule=ZBVZeroBubble"],
     "pipeline_parallel_schedule = 'ZBVZeroBubble'"),
    (["--config", "recipes/moe_debug.toml", "--parallelism.pipeline_parallel_degree=2"], "pipeline_parallel_degree = 2 with moe"),
    (["--parallelism.context_parallel_degree=2"], "context_parallel_degree = 2"),
    (["--config", "recipes/deepseek_v3_debug.toml", "--parallelism.tensor_parallel_degree=2"],
     "tensor_parallel_degree = 2 with deepseek_v3's MLA"),
])
def test_a_layout_torch_2_11_gets_wrong_is_refused_there_in_one_line(args, words):
    """On torch 2.11 (the whole suite run there: these layouts crash inside torch or train to other
    numbers than one process) each is one line naming the key, the torch and the fix; on torch 2.13
    and 2.14.1 the same layout passes the check (the suite trains every one of them), and so does a
    plain layout on 2.11."""
    from torchmeg.models.args import model_args
    from torchmeg.parallel.dims import ParallelDims
    from torchmeg.runtime.torch_versions import check_torch_version

    def parts(argv):
        cfg = load_config(argv[1], argv[2:])
        return cfg, model_args(cfg, None), ParallelDims.from_config(cfg, 2)
    if args[0] != "--config":
        args = ["--config", "recipes/debug_llama.toml"] + args
    cfg, model, dims = parts(args)
    with pytest.raises(ConfigError, match=re.escape(words) + r".*torch 2\.11\.0.*install torch>=2\.13"):
        check_torch_version(cfg, model, dims, version="2.11.0+cu130")
    for newer in ("2.13.0+cpu", "2.14.1"):
        check_torch_version(cfg, model, dims, version=newer)
    check_torch_version(*parts(["--config", args[1], "--parallelism.tensor_parallel_degree=1"]), version="2.11.0")


def test_keys_of_a_switched_off_section_get_a_note(capsys):
    """`--validation.freq=4` without `--validation.enable=true` leaves validation off: the command line
    says so before the run (rank 0, stdout; the run goes on). The DeepSeek-V3 and gpt-oss tests passed
    exactly that from 2026-11-24 and 11-26 on and compared a val_loss no run logged. A switch given on, or a recipe's own
    keys beside its switch off (debug_llama's [validation] keeps freq and steps), get no note."""
    from torchmeg.config.schema import idle_overrides
    argv = ["--config", RECIPE, "--validation.enable=false", "--validation.freq", "4", "--float8.recipe=rowwise",
            "--checkpoint.interval=3", "--training.steps=-3"]  # (a bad value: main stops after the note, no run)
    assert main(argv) == 2
    assert capsys.readouterr().out.splitlines() == [
        "torchmeg: note: --validation.freq does nothing: validation.enable = false (add --validation.enable=true)",
        "torchmeg: note: --float8.recipe does nothing: float8.enable = false (add --float8.enable=true)"]
    on = ["--float8.enable=true", "--float8.recipe=rowwise", "--lora.rank=4", "--lora.enable=true"]
    assert idle_overrides(load_config(RECIPE, on), on) == []
    off = ["--validation.enable=false"]
    assert idle_overrides(load_config(RECIPE, off), off) == []
