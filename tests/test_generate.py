"""Using a trained model: generation (KV cache, sampling, TP, compile) and evaluation.

The cached decode is checked against recomputing the whole sequence, greedy generation against
transformers' own `generate` on the exported weights, TP2 against one process, and `torchmeg.eval`
against the val_loss the run logged.
"""
import gc
import json
import math
import os
import sys
import weakref

import pytest
import torch

from conftest import FP32_PARITY, TINY, assert_close, assert_tensor_close, read_metrics, rel_diff
from launch import ROOT, launch_ranks, run_one, run_cli
from torchmeg.config.schema import load_config
from torchmeg.batching.generation import Sampling, decode_one, generate, sample
from torchmeg.models import build_model, materialize

PROMPTS = ["def fibonacci(n):", "import os", "class Parser:\n    def __init__(self, text"]


def _model(name: str):
    cfg = load_config("recipes/debug_llama.toml", [f"--model.name={name}", "--model.flavor=debug"])
    return materialize(build_model(cfg, 257, "meta"), "cpu", seed=0).eval()


@pytest.mark.parametrize("name", ["llama", "gpt2", "moe"])
def test_cached_decode_equals_recompute_and_batch_equals_alone(name):
    """Prompts of different lengths in one left-padded batch, 24 greedy steps: at every step the
    cached decode's logits equal recomputing the whole sequence (each prompt alone) within 1e-5 —
    the same fp32 math summed in another order (a masked kernel over the cache's prefix against the
    causal kernel over the whole sequence), relative to the logits' scale (conftest's rule) — and so
    do the tokens."""
    model = _model(name)
    prompts = [[5, 6, 7, 8, 9, 10, 11], [40, 41, 42], [100]]
    cached = generate(model, prompts, 24, -1, Sampling(), "cpu", keep_logits=True)
    recomputed = generate(model, prompts, 24, -1, Sampling(), "cpu", use_cache=False, keep_logits=True)
    for c, r in zip(cached, recomputed):
        assert c.tokens == r.tokens and len(c.tokens) == 24
        for a, b in zip(c.logits, r.logits):
            assert_tensor_close(a, b, FP32_PARITY, "cached vs recomputed logits")
    for p, c in zip(prompts, cached):  # and each prompt alone through the cache
        alone = generate(model, [p], 24, -1, Sampling(), "cpu", keep_logits=True)[0]
        assert alone.tokens == c.tokens
        for a, b in zip(alone.logits, c.logits):
            assert_tensor_close(a, b, FP32_PARITY, "alone vs batched logits")


def test_sampling_draws_from_the_shaped_distribution():
    """20,000 rows of one distribution, each its own stream: frequencies within 5 standard errors of
    the probabilities as temperature, top-k and top-p shape them."""
    n = 20000
    logits = torch.log(torch.tensor([0.1, 0.2, 0.3, 0.4])).expand(n, 4)
    streams = torch.arange(n)
    cases = [(Sampling(temperature=1.0), [0.1, 0.2, 0.3, 0.4]),
             (Sampling(temperature=1.0, top_k=2), [0, 0, 3 / 7, 4 / 7]),
             (Sampling(temperature=1.0, top_p=0.5), [0, 0, 3 / 7, 4 / 7]),  # 0.4 + 0.3 reaches 0.5
             (Sampling(temperature=0.5), [1 / 30, 4 / 30, 9 / 30, 16 / 30])]  # p^2, renormalised
    for s, want in cases:
        got = torch.bincount(sample(logits, s, streams, step=3), minlength=4).double() / n
        for g, w in zip(got.tolist(), want):
            assert abs(g - w) <= 5 * (w * (1 - w) / n) ** 0.5 + 1e-12, (s, got.tolist(), want)
    # greedy, and top-k 1 at any temperature, take the most likely token
    assert set(sample(logits, Sampling(), streams, 0).tolist()) == {3}
    assert set(sample(logits, Sampling(temperature=2.0, top_k=1), streams, 0).tolist()) == {3}


def test_repetition_penalty_is_transformers_processor_cached_or_not():
    """generate(..., repetition_penalty=p): greedy tokens = a decode loop applying transformers'
    RepetitionPenaltyLogitsProcessor(p) over prompt + generated, for prompts of different lengths in
    one batch (the KV cache) and one at a time without it; not the unpenalised tokens."""
    from transformers.generation.logits_process import RepetitionPenaltyLogitsProcessor
    model = _model("llama")
    prompts = [list(b"abcabcab"), list(b"xyx")]
    rep = RepetitionPenaltyLogitsProcessor(1.3)
    want = []
    with torch.no_grad():
        for prompt in prompts:
            seq = list(prompt)
            for _ in range(12):
                seq.append(int(rep(torch.tensor([seq]), model(torch.tensor([seq]))[:, -1].float())[0].argmax()))
            want.append(seq[len(prompt):])
    for use_cache in (True, False):
        got = generate(model, prompts, 12, -1, Sampling(), "cpu", use_cache=use_cache, repetition_penalty=1.3)
        assert [g.tokens for g in got] == want, use_cache
    assert [g.tokens for g in generate(model, prompts, 12, -1, Sampling(), "cpu")] != want


def test_generate_takes_what_the_command_line_leaves_out_from_generation_config(tmp_path):
    """torchmeg.generate as vLLM's LLM.generate on its default `--generation-config auto`: the flags
    left out take the generation_config.json beside the tokenizer (its values as transformers'
    GenerationConfig reads them), a flag given wins, `--generation-config vllm` or no file keeps the
    command line's defaults (greedy, 128 new tokens), and the header says what the file set."""
    from transformers import GenerationConfig
    from conftest import byte_level_bpe
    from torchmeg.config.errors import ConfigError
    from torchmeg.data.tokenizer import build_tokenizer
    from torchmeg.inference.generate import parse, resolve_sampling
    byte_level_bpe(tmp_path / "tokenizer.json", 300, ["<|end|>"])
    tok = build_tokenizer(str(tmp_path / "tokenizer.json"))
    base = ["--config", "x.toml", "--prompt", "hi"]

    def resolved(*flags):
        a, _ = parse(base + list(flags))
        return resolve_sampling(a, tok), a
    s, a = resolved()
    assert (s.temperature, s.top_k, s.top_p, s.min_p, a.repetition_penalty, a.max_new_tokens, a.note) == \
        (0.0, 0, 1.0, 0.0, 1.0, 128, "")
    release = {"do_sample": True, "temperature": 0.6, "top_p": 0.9, "top_k": 20, "min_p": 0.05,
               "repetition_penalty": 1.05, "max_new_tokens": 64, "eos_token_id": 1}
    (tmp_path / "generation_config.json").write_text(json.dumps(release))
    hf = GenerationConfig.from_pretrained(str(tmp_path))
    s, a = resolved()
    assert (s.temperature, s.top_k, s.top_p, s.min_p, a.repetition_penalty, a.max_new_tokens) == \
        (hf.temperature, hf.top_k, hf.top_p, hf.min_p, hf.repetition_penalty, hf.max_new_tokens)
    assert a.note.startswith("from the model's generation_config.json: temperature 0.6, top_k 20"), a.note
    s, a = resolved("--temperature", "0", "--max-new-tokens", "8")
    assert (s.temperature, s.top_p, a.max_new_tokens) == (0.0, 0.9, 8) and "temperature" not in a.note
    s, a = resolved("--generation-config", "vllm")
    assert (s.temperature, s.top_k, s.top_p, a.repetition_penalty, a.max_new_tokens, a.note) == \
        (0.0, 0, 1.0, 1.0, 128, "")
    (tmp_path / "generation_config.json").write_text(json.dumps({**release, "top_p": 1.5}))
    with pytest.raises(ConfigError, match=r"generation_config.json: top_p = 1.5 must be in \(0, 1\]"):
        resolved()
    with pytest.raises(ConfigError, match=r"--repetition-penalty 0.0: must be in \(0, 2\]"):
        resolved("--generation-config", "vllm", "--repetition-penalty", "0")


def test_sampled_generation_is_seeded_and_batch_independent():
    model = _model("llama")
    prompts = [[5, 6, 7, 8, 9, 10, 11], [40, 41, 42]]
    s = Sampling(temperature=0.9, top_k=50, top_p=0.9, seed=3)
    a = generate(model, prompts, 24, -1, s, "cpu")
    again = generate(model, prompts, 24, -1, s, "cpu")
    other = generate(model, prompts, 24, -1, Sampling(temperature=0.9, top_k=50, top_p=0.9, seed=4), "cpu")
    alone = [generate(model, [p], 24, -1, s, "cpu")[0] for p in prompts]
    assert [x.tokens for x in a] == [x.tokens for x in again] == [x.tokens for x in alone]
    assert [x.tokens for x in a] != [x.tokens for x in other]
    greedy = generate(model, prompts, 24, -1, Sampling(), "cpu")
    top1 = generate(model, prompts, 24, -1, Sampling(temperature=1.3, top_k=1, seed=9), "cpu")
    assert [x.tokens for x in top1] == [x.tokens for x in greedy]
    assert [x.tokens for x in a] != [x.tokens for x in greedy]  # sampling really sampled


@pytest.mark.parametrize("cache", ["generate", "engine"])
def test_a_dropped_cache_frees_its_buffers_at_once(cache):
    """A KV cache goes with its last reference: `generate`'s (models.kv_cache) and the engine's pool
    (batching.paged, what serving and GRPO's rollout run). A reference cycle between a cache and its
    layers kept every layer's K/V until the garbage collector ran: GRPO's rollout held it through the
    old policy's and the reference's log-prob forwards after it (12% of the debug recipe's rollout
    peak, tests/test_plan_post_training.py). The collector is off here: only reference counts free."""
    from torchmeg.batching.runner import ModelRunner
    from torchmeg.batching.scheduler import Plan
    from torchmeg.models.kv_cache import KVCache
    model = _model("llama")
    gc.disable()
    try:
        with torch.no_grad():
            if cache == "generate":
                owner = KVCache(1, 16)
                model(torch.tensor([[5, 6, 7, 8]]), positions=owner.positions(4), cache=owner)
            else:
                runner = ModelRunner(model, "cpu", 3, 16)
                runner.forward(Plan(prefill=[(0, 0, [5, 6, 7, 8]), (1, 0, [9, 10])], tables={0: [1], 1: [2]}))
                owner = runner.cache
                del runner
        buffers = [weakref.ref(layer.k) for layer in owner.layers.values()]
        assert len(buffers) == model.args.n_layers and all(b() is not None for b in buffers)
        del owner
        assert all(b() is None for b in buffers), "a dropped KV cache still holds its layers' buffers"
    finally:
        gc.enable()


def test_compiled_decode_compiles_once():
    """The decode step over a static cache compiles one graph and reuses it for every token of
    two generations; its tokens equal the eager ones."""
    from torch._dynamo.utils import counters
    from torchmeg.parallel.compile import setup
    setup()
    torch._dynamo.reset()
    counters.clear()
    model = _model("llama")
    step = torch.compile(decode_one, dynamic=False)
    prompts = [[5, 6, 7, 8, 9, 10, 11], [40, 41, 42]]
    eager = generate(model, prompts, 20, -1, Sampling(), "cpu")
    for _ in range(2):
        got = generate(model, prompts, 20, -1, Sampling(), "cpu", decode_step=step)
        assert [g.tokens for g in got] == [e.tokens for e in eager]
    assert counters["stats"]["unique_graphs"] == 1, dict(counters["stats"])
    assert counters["frames"]["ok"] == 1, dict(counters["frames"])


# ---- end to end: a trained checkpoint ------------------------------------------------------------

def _generate(args, env=None, nproc=1, check=True):
    cmd = [sys.executable, "-m", "torchmeg.generate"] + args + ["--json"]
    if nproc > 1:
        p = launch_ranks(cmd, nproc, dict(os.environ, **(env or {})), timeout=120)
    else:
        p = run_one(cmd, dict(os.environ, **(env or {})), 120)
    if check:
        assert p.returncode == 0, p.stderr[-3000:]
    return p, [json.loads(line) for line in p.stdout.splitlines() if line.startswith("{")]


def _prompt_args():
    return sum((["--prompt", p] for p in PROMPTS), [])


def _transformers_greedy(folder, rows, new_tokens=32, eos=256):
    from transformers import AutoModelForCausalLM
    hf = AutoModelForCausalLM.from_pretrained(str(folder)).eval()
    out = []
    for r in rows:
        ids = torch.tensor([r["prompt_tokens"]])
        with torch.no_grad():
            gen = hf.generate(ids, max_new_tokens=new_tokens, do_sample=False, eos_token_id=eos,
                              pad_token_id=eos)[0, ids.shape[1]:].tolist()
        out.append(gen[:gen.index(eos)] if eos in gen else gen)
    return out


@pytest.mark.slow
def test_greedy_equals_transformers_generate(debug_run):
    """Three prompts of different lengths in one batch, 32 greedy tokens each, from the trained
    checkpoint = transformers' generate(do_sample=False) on the weights checkpoint.export_hf wrote."""
    base = ["--config", "recipes/debug_llama.toml", f"--job.dump_folder={debug_run}", "--job.name=debug",
            "--max-new-tokens", "32"]
    _, rows = _generate(base + _prompt_args())
    assert [r["prompt"] for r in rows] == PROMPTS and all(len(r["tokens"]) == 32 for r in rows)
    assert [r["tokens"] for r in rows] == _transformers_greedy(debug_run / "debug" / "checkpoint" / "hf", rows)
    assert all(r["step"] == 30 and r["decode_tokens_per_sec"] > 0 and r["prefill_ms"] > 0 for r in rows)
    assert rows[0]["text"] == "".join(chr(t) for t in rows[0]["tokens"])  # byte tokenizer, ASCII here
    # A recipe that fuses the LM head into the loss still generates from logits: the same tokens.
    _, fused = _generate(base + _prompt_args() + ["--training.fused_linear_cross_entropy=true"])
    assert [r["tokens"] for r in fused] == [r["tokens"] for r in rows]


@pytest.mark.slow
def test_hf_recipe_greedy_equals_transformers_generate(tmp_path):
    run_cli(["--config", "recipes/hf_llama_debug.toml", "--training.steps=15", "--checkpoint.interval=15",
             "--data.seq_len=128",
             "--metrics.enable_tensorboard=false", "--validation.enable=false"], tmp_path, name="hf", timeout=240)
    _, rows = _generate(["--config", "recipes/hf_llama_debug.toml", f"--job.dump_folder={tmp_path}", "--job.name=hf",
                         "--max-new-tokens", "32"] + _prompt_args())
    assert [r["tokens"] for r in rows] == _transformers_greedy(tmp_path / "hf" / "checkpoint" / "hf", rows)


@pytest.mark.slow
def test_tp2_generation_equals_one_process(debug_run):
    base = ["--config", "recipes/debug_llama.toml", f"--job.dump_folder={debug_run}", "--job.name=debug",
            "--max-new-tokens", "24"] + _prompt_args()
    for extra in ([], ["--temperature", "0.9", "--top-p", "0.95", "--seed", "5"]):
        _, one = _generate(base + extra)
        _, two = _generate(base + extra, nproc=2)
        assert [r["tokens"] for r in two] == [r["tokens"] for r in one], extra
        assert {r["layout"] for r in two} == {"world 2: tp=2"} and {r["layout"] for r in one} == {"world 1: single device"}


@pytest.mark.slow
def test_fsdp2_checkpoint_generates_what_one_process_saves(tmp_path):
    """A checkpoint written by FSDP2 (sharded DTensors), and the same weights re-saved by one
    process (plain tensors): generation from each gives the same tokens."""
    import torch.distributed.checkpoint as dcp

    from torchmeg.checkpoint.manager import MARKER
    from torchmeg.checkpoint.states import ModelState
    args = TINY + ["--training.steps=8", "--checkpoint.enable=true", "--checkpoint.interval=8",
                   "--training.local_batch_size=2", "--parallelism.data_parallel_shard_degree=2"]
    run_cli(args, tmp_path, nproc=2, name="fsdp")
    src = tmp_path / "fsdp" / "checkpoint" / "step-00000008"
    cfg = load_config(None, [a for a in TINY if a.startswith("--model.")])
    model = build_model(cfg, 257, "cpu")
    dcp.load({"model": ModelState(model)}, checkpoint_id=str(src))
    dst = tmp_path / "one" / "checkpoint" / "step-00000008"
    dcp.save({"model": ModelState(model)}, checkpoint_id=str(dst))
    marker = json.loads((src / MARKER).read_text())
    (dst / MARKER).write_text(json.dumps(dict(marker, files=None, model_only=True, layout="world 1")))
    model_args = [a for a in TINY if a.startswith("--model.")]
    outs = []
    for name in ("fsdp", "one"):
        _, rows = _generate(model_args + ["--config", "recipes/debug_llama.toml", f"--job.dump_folder={tmp_path}",
                                          f"--job.name={name}", "--max-new-tokens", "16", "--temperature", "0.8",
                                          "--seed", "1"] + _prompt_args())
        outs.append([r["tokens"] for r in rows])
    assert outs[0] == outs[1] and all(len(t) for t in outs[0])


@pytest.mark.slow
def test_eval_reproduces_the_logged_val_loss(debug_run):
    """The first validation.steps global batches of the held-out split, as the trainer validates:
    the run's last val_loss, in one process (same arithmetic: to the bit) and under TP2 (1e-5: the
    row-parallel reductions sum in another order). The whole split gives perplexity = exp(loss)
    and bits per byte."""
    logged = [r for r in read_metrics(debug_run, "debug") if "val_loss" in r][-1]
    base = [sys.executable, "-m", "torchmeg.eval", "--config", "recipes/debug_llama.toml",
            f"--job.dump_folder={debug_run}", "--job.name=debug", "--json"]
    p = run_one(base + ["--steps", "4"], dict(os.environ), 120)
    assert p.returncode == 0, p.stderr[-3000:]
    one = json.loads(p.stdout.splitlines()[-1])
    assert one["loss"] == logged["val_loss"] and one["step"] == 30 and one["windows"] == 32
    p = launch_ranks(base + ["--steps", "4", "--parallelism.tensor_parallel_degree=2"], 2, dict(os.environ), 120)
    assert p.returncode == 0, p.stderr[-3000:]
    tp = json.loads(p.stdout.splitlines()[-1])
    assert_close(tp["loss"], logged["val_loss"], FP32_PARITY, "TP2 eval loss")
    assert tp["layout"] == "world 2: tp=2"
    # The fused head + loss (its own sums, in chunks): fp32 reordering, the parity rule.
    p = run_one(base + ["--steps", "4", "--training.fused_linear_cross_entropy=true"], dict(os.environ), 120)
    assert p.returncode == 0, p.stderr[-3000:]
    assert_close(json.loads(p.stdout.splitlines()[-1])["loss"], logged["val_loss"], FP32_PARITY, "fused eval loss")
    p = run_one(base, dict(os.environ), 120)
    whole = json.loads(p.stdout.splitlines()[-1])
    assert whole["windows"] > one["windows"] and rel_diff(whole["perplexity"], math.exp(whole["loss"])) < 1e-12
    # bits per byte: the byte tokenizer's labels are bytes except end-of-document, so just above loss / ln 2
    assert whole["bits_per_byte"] >= whole["loss"] / math.log(2)


@pytest.mark.slow
@pytest.mark.parametrize("extra, needle", [
    (["--top-p", "0"], "--top-p 0.0: must be in (0, 1]"),
    (["--top-p", "1.5"], "--top-p 1.5: must be in (0, 1]"),
    (["--temperature", "-1"], "--temperature -1.0: must be a finite number >= 0"),
    (["--prompt", "x" * 3000], "--prompt #2: 3000 tokens, but the model's max_seq_len is 2048"),
    (["--max-new-tokens", "2046"], "--max-new-tokens 2046: prompt #1 (3 tokens) + 2046 new ones exceed"),
    ([], None),  # below: no checkpoint in the run folder
])
def test_generate_refuses_bad_input_in_one_line(extra, needle, tmp_path):
    p, _ = _generate(["--config", "recipes/debug_llama.toml", f"--job.dump_folder={tmp_path}", "--prompt", "abc"]
                     + extra, check=False)
    line = p.stderr.strip().splitlines()[-1]
    assert p.returncode == 2, p.stderr[-2000:]
    assert line.startswith("torchmeg.generate: error: ")
    assert needle in line if needle else ("no committed checkpoint in" in line and "checkpoint.folder" in line), line


@pytest.mark.slow
def test_generate_refuses_another_tokenizer(debug_run, tmp_path):
    from torchmeg.data.tokenizer import train_bpe
    tok = tmp_path / "bpe.json"
    train_bpe([open(os.path.join(ROOT, "torchmeg", "config", "schema.py")).read()], 300, str(tok))
    p, _ = _generate(["--config", "recipes/debug_llama.toml", f"--job.dump_folder={debug_run}", "--job.name=debug",
                      f"--data.tokenizer={tok}", "--prompt", "abc"], check=False)
    assert p.returncode == 2, p.stderr[-2000:]
    line = p.stderr.strip().splitlines()[-1]
    assert "was trained with tokenizer byte-v1" in line and "data.tokenizer" in line, line


@pytest.mark.slow
def test_tp_beyond_the_kv_heads_replicates_them(tmp_path):
    """One KV head (MQA), two ranks: each rank builds a copy of the head its query heads read
    (inference.kv_replicas) and sampled generation equals one process's; three ranks
    (not dividing the query heads) are refused in one line."""
    model = [a for a in TINY if a.startswith("--model.")] + ["--model.n_kv_heads=1"]
    run_cli(model + [a for a in TINY if not a.startswith("--model.")] + [
        "--config", "recipes/debug_llama.toml", "--training.steps=6", "--checkpoint.interval=6",
        "--validation.enable=false"], tmp_path, name="mqa")
    base = model + ["--config", "recipes/debug_llama.toml", f"--job.dump_folder={tmp_path}", "--job.name=mqa",
                    "--max-new-tokens", "16"] + _prompt_args()
    sampled = ["--temperature", "0.9", "--seed", "5"]
    _, one = _generate(base + sampled)
    _, two = _generate(base + sampled, nproc=2)
    assert [r["tokens"] for r in two] == [r["tokens"] for r in one] and len(one[0]["tokens"]) == 16
    assert {r["layout"] for r in two} == {"world 2: tp=2"}
    from torchmeg.config.errors import ConfigError
    from torchmeg.inference.kv_replicas import replicate_kv_heads
    with pytest.raises(ConfigError, match=r"^3 processes \(tensor parallel\): beyond the model's 1 KV heads"):
        replicate_kv_heads(load_config("recipes/debug_llama.toml", model), 3)
