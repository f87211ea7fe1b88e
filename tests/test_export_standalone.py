"""An exported folder stands alone (torchmeg.checkpoint.hf_tokenizer): transformers, lm-eval's `hf`
backend and the Hub read it with nothing else beside it — the tokenizer the run trained with, the
special ids, generation_config.json — and generate what torchmeg generates, up to and including the
end of text. Judged by transformers and lm-eval themselves, on folders built here."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from conftest import FP32_PARITY, TINY, byte_level_bpe
from launch import ROOT, run_one, run_cli

DOCS = ["one two three.", "red green blue.", "cat dog bird.", "sun moon star."]
PROMPTS = ["one two", "red", "sun moon", "ünï ✓"]
EOS = 256  # the byte tokenizer's end of text
FILES = ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json")


def _tool(*args) -> subprocess.CompletedProcess:
    cmd = [sys.executable, *map(str, args)]  # (`-m` commands: a fork of the suite's zygote)
    p = run_one(cmd, dict(os.environ), 120) if args[0] == "-m" else \
        subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr[-3000:]
    return p


@pytest.mark.slow
def test_a_trained_runs_export_generates_torchmegs_tokens_in_transformers_and_lm_eval(tmp_path):
    """A run trained on short documents (each ends with the end of text, so the model learns to stop);
    its end-of-run export and `convert to-hf` of its checkpoint: transformers loads each folder alone,
    tokenizes the prompts to torchmeg's ids, and its greedy `generate` (generation_config.json's
    settings, nothing passed) gives torchmeg.generate's tokens and stops at the same end of text; lm-eval's
    HFLM on the folder gives torchmeg's log-likelihoods."""
    from lm_eval.api.instance import Instance
    from lm_eval.models.huggingface import HFLM
    from transformers import AutoModelForCausalLM, AutoTokenizer
    (tmp_path / "docs.jsonl").write_text("\n".join(json.dumps({"text": d}) for d in DOCS * 50) + "\n")
    _tool("tools/preprocess_data.py", "--input", tmp_path / "docs.jsonl", "--output-prefix", tmp_path / "docs")
    model = [a for a in TINY if a.startswith("--model.")]
    args = TINY + ["--config", "recipes/debug_llama.toml", f"--data.dataset={tmp_path / 'docs'}", "--training.steps=60",
                   "--optimizer.lr=1e-2", "--validation.enable=false", "--checkpoint.enable=true",
                   "--checkpoint.interval=60", "--checkpoint.export_hf=true"]
    run_cli(args, tmp_path)
    ckpt = tmp_path / "run" / "checkpoint"
    _tool("-m", "torchmeg.convert", "to-hf", ckpt, "--config", "recipes/debug_llama.toml", *model,
          "--out", tmp_path / "back")
    p = _tool("-m", "torchmeg.generate", "--config", "recipes/debug_llama.toml", *model, f"--job.dump_folder={tmp_path}",
              "--job.name=run", "--max-new-tokens", "24", "--json", *sum((["--prompt", t] for t in PROMPTS), []))
    rows = [json.loads(line) for line in p.stdout.splitlines() if line.startswith("{")]
    assert [r["prompt"] for r in rows] == PROMPTS
    assert sum(r["finish_reason"] == "eos" for r in rows) >= 3, rows  # the end of text is in range
    for folder in (ckpt / "hf", tmp_path / "back"):
        assert all((folder / f).is_file() for f in FILES), sorted(os.listdir(folder))
        assert json.loads((folder / "config.json").read_text())["eos_token_id"] == EOS
        tok = AutoTokenizer.from_pretrained(str(folder))
        hf = AutoModelForCausalLM.from_pretrained(str(folder)).eval()
        assert tok.eos_token_id == EOS and hf.generation_config.eos_token_id == EOS
        for r in rows:
            enc = tok(r["prompt"], return_tensors="pt")
            assert enc.input_ids[0].tolist() == r["prompt_tokens"], (folder, r["prompt"])
            with torch.no_grad():
                out = hf.generate(**enc, max_new_tokens=24, do_sample=False)[0, enc.input_ids.shape[1]:].tolist()
            assert out == r["tokens"] + ([EOS] if r["finish_reason"] == "eos" else []), (folder, r["prompt"], out)
            assert tok.decode(out, skip_special_tokens=True) == r["text"]

    lm = HFLM(pretrained=str(ckpt / "hf"), device="cpu", batch_size=1)
    pairs = [("one two", " three."), ("one two", " blue."), ("sun", " moon star."), ("ünï", " ✓")]
    got = [ll for ll, _ in lm.loglikelihood([Instance("loglikelihood", {}, pair, i) for i, pair in enumerate(pairs)])]
    import torch.distributed.checkpoint as dcp
    from torchmeg.config.schema import load_config
    from torchmeg.models import build_model
    ours = build_model(load_config(os.path.join(ROOT, "recipes/debug_llama.toml"), model), 257, "cpu").eval()
    sd = {"model": ours.state_dict()}
    dcp.load(sd, checkpoint_id=str(ckpt / "step-00000060"), no_dist=True)
    ours.load_state_dict(sd["model"])
    for (context, continuation), ll in zip(pairs, got):
        ctx, cont = list(context.encode()), list(continuation.encode())
        with torch.no_grad():
            logits = ours(torch.tensor([ctx + cont])).double()[0]
        rows = logits[len(ctx) - 1:len(ctx) - 1 + len(cont)]
        lse = torch.logsumexp(rows, -1)
        want = sum((rows[i, t] - lse[i]).item() for i, t in enumerate(cont))
        # each token's log-prob is a logit minus the log-sum-exp, each rounded at fp32's relative 2^-24
        # of its own size: the rule's 1e-5 relative to those terms, not to their small difference (a
        # likely continuation's log-likelihood is near 0: -0.03 here)
        scale = sum(abs(rows[i, t].item()) + abs(lse[i].item()) for i, t in enumerate(cont))
        assert abs(want - ll) <= FP32_PARITY * scale, (continuation, context, want, ll, scale)


LLAMA3_SPECIAL = ["<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"]


@pytest.mark.slow
def test_a_releases_tokenizer_and_generation_config_go_through_from_hf_and_to_hf(tmp_path):
    """A Llama-3.1-shaped release (rope scaling, a Llama-3-style tokenizer, TRL's copy of the real
    template, an instruct generation_config.json listing two ends): converted in and back out, the
    folder carries the release's tokenizer files and generation settings unchanged, config.json the
    release's ids, transformers renders and tokenizes a conversation as the release did, and lm-eval's
    HFLM loads it."""
    import trl
    from lm_eval.models.huggingface import HFLM
    from transformers import AutoTokenizer
    from test_convert import _hf_folder
    release = tmp_path / "hf"
    _hf_folder(release, "llama31")
    byte_level_bpe(release / "tokenizer.json", 320, LLAMA3_SPECIAL)
    ids = json.loads((release / "tokenizer.json").read_text())["model"]["vocab"]
    (release / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<|begin_of_text|>", "eos_token": "<|eot_id|>",
        "model_max_length": 512}))
    template = os.path.join(os.path.dirname(trl.__file__), "chat_templates", "llama3_1.jinja")
    (release / "chat_template.jinja").write_text(open(template).read())
    generation = {"bos_token_id": ids["<|begin_of_text|>"], "eos_token_id": [ids["<|end_of_text|>"], ids["<|eot_id|>"]],
                  "do_sample": True, "temperature": 0.6, "top_p": 0.9}
    (release / "generation_config.json").write_text(json.dumps(generation))
    _tool("-m", "torchmeg.convert", "from-hf", release, "--out", tmp_path / "out")
    _tool("-m", "torchmeg.convert", "to-hf", tmp_path / "out" / "checkpoint", "--config", tmp_path / "out" / "recipe.toml",
          "--out", tmp_path / "back")
    back = tmp_path / "back"
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "generation_config.json"):
        assert (back / name).read_bytes() == (release / name).read_bytes() or name == "tokenizer_config.json", name
    config = json.loads((back / "config.json").read_text())
    assert config["eos_token_id"] == generation["eos_token_id"] and config["bos_token_id"] == generation["bos_token_id"]
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "2 + 2?"},
                {"role": "assistant", "content": "4"}]
    theirs, ours = AutoTokenizer.from_pretrained(str(release)), AutoTokenizer.from_pretrained(str(back))
    assert ours.apply_chat_template(messages, tokenize=False) == theirs.apply_chat_template(messages, tokenize=False)
    assert ours("def main(argv):").input_ids == theirs("def main(argv):").input_ids
    assert ours.eos_token == "<|eot_id|>" and ours.bos_token == "<|begin_of_text|>"
    assert HFLM(pretrained=str(back), device="cpu", batch_size=1).eot_token_id == ids["<|eot_id|>"]


def test_a_chat_runs_export_names_its_end_of_turn_and_renders_its_template(tmp_path):
    """An sft run's export (no process: the writer itself): a tokenizer.json whose end of turn is one
    token lists it beside the end of text in generation_config.json; a built-in template on the byte
    tokenizer is written so transformers renders exactly what torchmeg's template renders."""
    from transformers import AutoTokenizer
    from torchmeg.checkpoint.hf_tokenizer import write_generation_files
    from torchmeg.config.schema import load_config
    from torchmeg.data.chat import chat_template
    from torchmeg.data.tokenizer import build_tokenizer
    byte_level_bpe(tmp_path / "tokenizer.json", 400, ["<|endoftext|>", "<|im_start|>", "<|im_end|>"])
    messages = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "ünï"}]
    for name, tokenizer, template in (("bpe", str(tmp_path / "tokenizer.json"), "chatml"), ("byte", "byte", "llama3")):
        cfg = load_config(None, ["--training.objective=sft", f"--data.tokenizer={tokenizer}",
                                 f"--data.chat_template={template}"])
        out = tmp_path / name
        out.mkdir()
        (out / "config.json").write_text("{}")
        tok = build_tokenizer(tokenizer)
        write_generation_files(cfg, tok, str(out))
        eos = json.loads((out / "generation_config.json").read_text())["eos_token_id"]
        end = chat_template(cfg).end_of_turn(tok)[1]
        assert eos == ([tok.eos_id, end] if name == "bpe" else tok.eos_id), (name, eos)  # byte: '<|eot_id|>' is 9 tokens
        hf = AutoTokenizer.from_pretrained(str(out))
        assert hf.apply_chat_template(messages, tokenize=False) == chat_template(cfg).render(messages), name
        assert hf.eos_token_id == tok.eos_id == json.loads((out / "config.json").read_text())["eos_token_id"]
