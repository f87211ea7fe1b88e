"""The core install runs every job that needs no extra: the README's first command installs torch and
torchmeg alone (`pip install -e .`), while this suite's venv holds every extra. Each job below runs in
a fresh interpreter whose imports cannot see any package the core install would lack
(tests/core_only/sitecustomize.py: the closure of torchmeg's own requirements is all there is):
pretraining, SFT, DPO and GRPO on a built-in task, generate, eval, plan and convert both ways; the
server, which needs the serve extra, stops before it starts with one line naming the extra, exit 2.

Before this test, the trainer imported the serving engine's Prometheus metrics at the top of every job
(`ModuleNotFoundError: No module named 'prometheus_client'` on the README's first command).
"""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from launch import ROOT

pytestmark = pytest.mark.slow
CORE_ONLY = os.path.join(ROOT, "tests", "core_only")
RECIPES = os.path.join(ROOT, "recipes")
SHORT = ["--training.steps=2", "--metrics.log_freq=1", "--validation.enable=false", "--metrics.enable_tensorboard=false"]


def core(args: list[str], cwd, timeout: int = 120) -> subprocess.CompletedProcess:
    """`python ARGS` as on the core install: every extra's packages invisible (to its children too)."""
    env = dict(os.environ, TORCHMEG_CORE_ONLY="1", PYTHONUNBUFFERED="1",
               PYTHONPATH=os.pathsep.join([CORE_ONLY, ROOT]))
    return subprocess.run([sys.executable] + args, cwd=cwd, env=env, capture_output=True, text=True,
                          timeout=timeout, stdin=subprocess.DEVNULL)


def ok(p: subprocess.CompletedProcess) -> str:
    assert p.returncode == 0, f"exit {p.returncode}: {' '.join(p.args[1:])}\n{p.stdout[-2000:]}\n{p.stderr[-4000:]}"
    return p.stdout


def test_the_emulated_core_install_hides_every_extra(tmp_path):
    """The emulation itself: the extras' packages (and what only they bring: triton, the test extra's)
    are not found, while what torchmeg requires is, a core package's own vendored copies included
    (torch's cpp_extension, which inductor's CPU compile imports, loads setuptools' more_itertools);
    a test of the jobs below means nothing if this fails."""
    probe = ("import importlib.util as u, json; print(json.dumps({m: u.find_spec(m) is not None for m in "
             "['prometheus_client', 'fastapi', 'uvicorn', 'starlette', 'pydantic', 'pyarrow', 'transformers',"
             " 'trl', 'peft', 'openai', 'matplotlib', 'triton', 'torch', 'torchao', 'torchdata', 'tokenizers',"
             " 'safetensors', 'numpy', 'tensorboard', 'jinja2']}))\n"
             "import torch.utils.cpp_extension, more_itertools; print(more_itertools.__file__)")
    lines = ok(core(["-c", probe], tmp_path)).strip().splitlines()
    seen = json.loads(lines[-2])
    hidden = {m for m, found in seen.items() if not found}
    assert hidden == {"prometheus_client", "fastapi", "uvicorn", "starlette", "pydantic", "pyarrow", "transformers",
                      "trl", "peft", "openai", "matplotlib", "triton"}, seen
    assert os.path.join("setuptools", "_vendor") in lines[-1], lines[-1]  # (setuptools' copy, not the venv's)


@pytest.fixture(scope="module")
def pretrained(tmp_path_factory):
    """The default recipe, 2 steps, on the core install: the checkpoint the other jobs start from."""
    d = tmp_path_factory.mktemp("core")
    out = ok(core(["-m", "torchmeg.train", "--config", f"{RECIPES}/debug_llama.toml", "--job.dump_folder=out"]
                  + SHORT, d))
    assert "step     2 | loss" in out and "[checkpoint] step 2 committed" in out
    return d


POST_TRAINING = {
    "sft": ["--config", f"{RECIPES}/sft_debug.toml", "--data.seq_len=256", "--training.local_batch_size=2"],
    "dpo": ["--config", f"{RECIPES}/dpo_debug.toml", "--data.dataset=pairs.jsonl", "--data.seq_len=64",
            "--training.local_batch_size=2"],
    "grpo": ["--config", f"{RECIPES}/grpo_debug.toml", "--training.local_batch_size=4", "--training.global_batch_size=4",
             "--grpo.num_generations=2", "--grpo.max_completion_length=8", "--data.seq_len=336"],
}


@pytest.mark.parametrize("objective", list(POST_TRAINING))
def test_post_training_objectives_run_on_the_core_install(objective, pretrained):
    """From the pretrained checkpoint; DPO on 8 pairs of its own (the built-in set's reference pass is
    a minute), GRPO on the built-in task (its rollouts: the serving engine, in the training process)."""
    d = pretrained
    start = ["--job.dump_folder=out", "--checkpoint.initial_load_path=out/debug_llama/checkpoint",
             f"--job.name={objective}"] + SHORT
    (d / "pairs.jsonl").write_text("".join(json.dumps({"prompt": f"What is {i} + {i}?", "chosen": f"{2 * i}.",
                                                       "rejected": f"{2 * i + 1}, I think."}) + "\n"
                                           for i in range(8)))
    out = ok(core(["-m", "torchmeg.train"] + POST_TRAINING[objective] + start, d))
    assert "init       from" in out and "step     2 | loss" in out, out[-1500:]
    assert ("| reward " in out) == (objective == "grpo"), out[-1500:]


def test_inference_plan_and_convert_run_on_the_core_install_and_serve_names_its_extra(pretrained):
    d = pretrained
    recipe = ["--config", f"{RECIPES}/debug_llama.toml", "--job.dump_folder=out"]
    out = ok(core(["-m", "torchmeg.generate"] + recipe + ["--prompt", "def f(", "--max-new-tokens", "4"], d))
    assert "4 new tokens" in out
    out = ok(core(["-m", "torchmeg.eval"] + recipe + ["--steps", "1", "--json"], d))
    assert json.loads(out.strip().splitlines()[-1])["loss"] > 0
    out = ok(core(["-m", "torchmeg.plan", "--config", f"{RECIPES}/debug_llama.toml", "--world", "2"], d))
    assert "predicted: step" in out
    ok(core(["-m", "torchmeg.convert", "to-hf", "out/debug_llama/checkpoint"] + recipe + ["--out", "hf"], d))
    assert (d / "hf" / "config.json").is_file()
    out = ok(core(["-m", "torchmeg.convert", "from-hf", "hf", "--out", "back"], d))
    assert (d / "back" / "recipe.toml").is_file()
    p = core(["-m", "torchmeg.serve"] + recipe, d)
    assert p.returncode == 2, (p.returncode, p.stderr[-2000:])
    lines = p.stderr.strip().splitlines()
    assert len(lines) == 1 and "pip install 'torchmeg[serve]'" in lines[0] and "not installed" in lines[0], p.stderr
