"""GRPO judged by TRL 1.16's GRPOTrainer itself, run whole on the same completions: two optimizer steps.

tests/test_grpo.py holds each loss type against TRL's `_compute_loss` on one batch. Here the judge is
the trainer: a transformers-written Llama folder with a Llama-3 style tokenizer (its post-processor adds
a BOS), standard `{"prompt": ...}` records, a reward function written for TRL. torchmeg trains on it
(`model.name = "hf"`, `checkpoint.initial_load_hf`) and logs every completion; a real `trl.GRPOTrainer`
on the same folder is fed those completions through its public `rollout_func` and trains too. Everything
between the completions and the update is each side's own: the prompts' tokenization, rewards,
advantages (TRL's `scale_rewards = "group"`), the old policy's log-probs (num_iterations 2: step 2
trains on step 1's rollouts with the policy moved, so its ratio is off 1), the reference (beta > 0: TRL's
copy loaded from the folder), the KL with TRL's default bias correction, the microbatches (TRL's
gradient_accumulation_steps 2: it shuffles the 16 rows and splits them), dapo's normalization over the
whole batch, clipping of the gradient norm, and AdamW's first step.

TRL runs on its defaults but for what the case names and what this CPU and a two-step test need:
`use_cpu`, `bf16 = False` (fp32: TRL's default bf16 needs a GPU), `max_steps`, `logging_steps = 1`,
`report_to`, `save_strategy`, `gradient_accumulation_steps = 2` (several microbatches),
`num_iterations = 2`, a learning rate that moves the policy in one step, `max_completion_length`, and
Adam's epsilon (ADAM_EPS below: numerics, not the algorithm).
torchmeg is set to what those mean: AdamW with TRL's betas (0.9, 0.999) and that eps, no weight decay,
a linear decay without warmup (TRL's schedule), max_norm 1.0.

Compared at steps 1 and 2 (fp32 throughout, 1e-5 relative, tests/conftest.py's rule): the loss, the
gradient norm, the KL; at step 2 every parameter's gradient (after clipping, as the optimizer sees it):
TRL's from a callback just before its optimizer step, torchmeg's as AdamW's first moment in its step-2
checkpoint, run with beta1 = 0 so that moment is the step's gradient itself. That changes nothing
compared: AdamW's first update is lr g / (|g| + eps) whatever the betas (both moments are bias-corrected
to g and g^2), so the weights step 2 starts from, its loss and its gradient are those of TRL's betas.
"""
import collections
import json
import os

import pytest
import torch

from conftest import assert_close, byte_level_bpe, read_metrics, user_module
from launch import run_cli

pytestmark = pytest.mark.slow

G, ROWS, MICRO, COMPLETION = 8, 16, 8, 12  # TRL's num_generations and per_device_train_batch_size; 2 prompts
BETAS = (0.9, 0.999)  # TRL's (transformers' adam_beta1, adam_beta2)
LR = 1e-3
# Adam's epsilon, the one numerical key set on both sides: AdamW's first update is lr g / (|g| + eps),
# so a gradient element near eps (attention's q/k gradients hold many ~1e-8 here) moves its weight by up
# to lr on the sign of its fp32 roundoff. At TRL's 1e-8 the step-2 loss and gradient norm still agree to
# 1e-5, the whole gradient to ~2e-5 of its norm (bnpo); at 1e-4 to ~5e-7, q and k to ~1.4e-5 of theirs.
ADAM_EPS = 1e-4
REWARDS = ("def distinct(completions, completion_ids, **kwargs):\n"
           "    return [len(set(ids)) / 4.0 for ids in completion_ids]\n")
PROMPTS = ["Write a haiku about the sea.", "What does json.loads do?", "Name a function in textwrap.",
           "Count to five in French."]


def _folder(path):
    """A 2-layer Llama as transformers writes it, and a byte-level BPE whose post-processor adds the
    BOS (Llama-3 style): TRL's `tokenizer(prompt)` starts with it."""
    from tokenizers import Tokenizer, processors
    from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM
    os.makedirs(path)
    tok_path = os.path.join(path, "tokenizer.json")
    byte_level_bpe(tok_path, 300, ["<|begin_of_text|>", "<|end_of_text|>"])
    tok = Tokenizer.from_file(tok_path)
    bos, eos = tok.token_to_id("<|begin_of_text|>"), tok.token_to_id("<|end_of_text|>")
    tok.post_processor = processors.TemplateProcessing(single="<|begin_of_text|> $A",
                                                       special_tokens=[("<|begin_of_text|>", bos)])
    tok.save(tok_path)
    with open(os.path.join(path, "tokenizer_config.json"), "w") as fh:
        json.dump({"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<|begin_of_text|>",
                   "eos_token": "<|end_of_text|>", "model_max_length": 4096}, fh)
    config = LlamaConfig(vocab_size=320, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                         bos_token_id=bos, eos_token_id=eos, tie_word_embeddings=False)
    torch.manual_seed(3)
    model = LlamaForCausalLM(config)
    with torch.no_grad():  # every position's state leans one way, and the EOS row reads it: p(EOS) ~ 0.15 a
        u = torch.randn(64)  # token, so completions end at varied lengths (equal lengths make dapo's
        u /= u.norm()        # on-policy loss 0: sum over rows of advantage x length, the advantages summing to 0)
        model.model.embed_tokens.weight += u
        model.lm_head.weight[eos] = 4.0 * u / 64 ** 0.5
    model.save_pretrained(path)
    GenerationConfig(bos_token_id=bos, eos_token_id=eos).save_pretrained(path)


def _torchmeg(tmp_path, folder, keys: dict) -> tuple[list[dict], list[dict], dict]:
    """torchmeg's run: (metrics per step, step 1's completions, step 2's gradient by parameter name)."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save
    name = "torchmeg"
    data = tmp_path / "prompts.jsonl"
    data.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in PROMPTS))
    rewards = user_module(tmp_path, "trl_rewards.py", REWARDS)  # (one folder for the test run: one fork server)
    args = ["--job.seed=0", "--model.name=hf", f"--model.hf_config={folder}", "--model.vocab_size=320",
            f"--checkpoint.initial_load_hf={folder}", f"--data.tokenizer={folder}/tokenizer.json", f"--data.dataset={data}",
            "--data.seq_len=64", "--training.objective=grpo", "--training.steps=2",
            f"--training.global_batch_size={ROWS}", f"--training.local_batch_size={MICRO}", "--training.max_norm=1.0",
            "--training.mixed_precision=fp32", "--training.deterministic=true", f"--grpo.num_generations={G}",
            "--grpo.num_iterations=2", "--grpo.max_prompt_length=32",
            f"--grpo.max_completion_length={COMPLETION}", '--grpo.reward_funcs=["trl_rewards:distinct"]',
            "--grpo.log_completions=true", "--optimizer.name=adamw", f"--optimizer.lr={LR}",
            f"--optimizer.betas=[0.0,{BETAS[1]}]", f"--optimizer.eps={ADAM_EPS}", "--optimizer.weight_decay=0.0",
            "--lr_scheduler.warmup_steps=0", "--lr_scheduler.decay_type=linear", "--lr_scheduler.min_lr_ratio=0.0",
            "--validation.enable=false", "--metrics.log_freq=1", "--metrics.enable_tensorboard=false",
            "--checkpoint.enable=true", "--checkpoint.interval=2", "--checkpoint.export_hf=false"]
    args += [f"--grpo.{k}={v}" for k, v in {"beta": 0.0, **keys}.items()]  # (TRL's default beta; its keys' names)
    env = {"PYTHONPATH": rewards + os.pathsep + os.environ.get("PYTHONPATH", "")}
    run_cli(args, tmp_path, name=name, env=env, timeout=180)
    metrics = read_metrics(tmp_path, name)
    with open(tmp_path / name / "completions.jsonl") as fh:
        rollouts = [r for r in map(json.loads, fh) if r["step"] == 1]
    out = tmp_path / f"{name}_step2.pt"
    dcp_to_torch_save(str(tmp_path / name / "checkpoint" / "step-00000002"), str(out))
    grads = {k.removesuffix(".exp_avg"): v for k, v in _flatten(torch.load(out, weights_only=False)).items()
             if k.endswith("exp_avg")}
    return metrics, rollouts, grads


def _flatten(tree, prefix="") -> dict:
    if isinstance(tree, dict):
        out = {}
        for k, v in tree.items():
            out.update(_flatten(v, f"{prefix}.{k}" if prefix else str(k)))
        return out
    return {prefix: tree}


def _trl(tmp_path, folder, rollouts, keys: dict, monkeypatch) -> tuple[list[dict], dict]:
    """TRL's GRPOTrainer on the folder, fed torchmeg's completions: (its log per step, step 2's gradients)."""
    import importlib
    from datasets import Dataset
    from transformers import AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer
    from trl.trainer import grpo_trainer
    # TRL shuffles the 16 rows before it cuts them into its 2 microbatches (a random split); torchmeg
    # keeps the rollouts' order. The split changes no loss or gradient here (dapo divides each token's
    # term by the whole batch's token count; bnpo and grpo's microbatch means come out the same for
    # equal halves only if the halves are the same rows), and the metrics below are read per microbatch:
    # with the shuffle off, TRL's microbatch k holds the k-th prompt's group, as torchmeg's.
    monkeypatch.setattr(grpo_trainer, "shuffle_sequence_dict", lambda batch: batch)
    monkeypatch.setenv("TRL_EXPERIMENTAL_SILENCE", "1")
    monkeypatch.syspath_prepend(user_module(tmp_path, "trl_rewards.py", REWARDS))
    distinct = importlib.import_module("trl_rewards").distinct
    tokenizer = AutoTokenizer.from_pretrained(folder)
    groups = collections.defaultdict(list)
    for r in sorted(rollouts, key=lambda r: r["row"]):
        groups[r["prompt"]].append(r["completion_ids"])
    assert len(groups) == ROWS // G and all(len(g) == G for g in groups.values())

    def rollout_func(prompts, trainer):
        taken = collections.Counter()
        order.extend(p for i, p in enumerate(prompts) if i % G == 0)
        out = {"prompt_ids": [], "completion_ids": [], "logprobs": []}
        for p in prompts:
            ids = groups[p][taken[p]]
            taken[p] += 1
            out["prompt_ids"].append(tokenizer(p)["input_ids"])  # TRL's tokenization of a standard prompt
            out["completion_ids"].append(ids)
            out["logprobs"].append([0.0] * len(ids))  # (read only for vLLM's importance sampling: off)
        return out

    grads, per_micro, order = {}, [], []

    class Grab(TrainerCallback):
        def on_pre_optimizer_step(self, args, state, control, model=None, **kwargs):
            if state.global_step == 1:  # (0-based: the second optimizer step)
                grads.update({n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None})

        def on_step_end(self, args, state, control, **kwargs):  # (before the step's log averages and clears them)
            per_micro.append({k: list(v) for k, v in self.trainer._metrics["train"].items()})

    config = GRPOConfig(output_dir=str(tmp_path / "trl"), use_cpu=True, bf16=False, max_steps=2, logging_steps=1,
                        report_to="none", save_strategy="no", gradient_accumulation_steps=ROWS // MICRO,
                        num_iterations=2, learning_rate=LR, max_completion_length=COMPLETION,
                        adam_epsilon=ADAM_EPS, **keys)
    assert (config.num_generations, config.per_device_train_batch_size) == (G, MICRO)  # TRL's defaults, not set
    trainer = GRPOTrainer(model=folder, reward_funcs=distinct, args=config, processing_class=tokenizer,
                          train_dataset=Dataset.from_list([{"prompt": p} for p in groups]),
                          rollout_func=rollout_func, callbacks=[grab := Grab()])
    grab.trainer = trainer
    trainer.train()
    logs = [h for h in trainer.state.log_history if "loss" in h]
    # TRL logs kl, entropy and the clip shares as the mean of its microbatches' means; torchmeg as the
    # mean over every token of the step (the same in every layout: a layout that splits the batch into
    # other microbatches logs the same numbers, tests/test_grpo.py). Both from TRL's own per-microbatch
    # values: torchmeg's = them weighted by each microbatch's tokens (its rows' for a per-sequence ratio).
    tokens = [sum(len(ids) for ids in groups[p]) for p in order]
    for log, values in zip(logs, per_micro):
        for key in METRICS:
            if key in values:
                per_row = key not in ("entropy", "kl") and keys.get("importance_sampling_level") == "sequence"
                w = [float(G)] * len(order) if per_row else tokens
                assert len(values[key]) == len(w), (key, values[key])
                log[key] = sum(v * n for v, n in zip(values[key], w)) / sum(w)
    return logs, grads


# TRL's defaults (dapo, beta 0), then each case's keys as a user sets them in GRPOConfig (the same names
# in torchmeg's [grpo]): the KL with its default bias correction, the loss types whose normalization
# differs (bnpo: a microbatch's tokens; dr_grpo: a constant; grpo: per sequence), GSPO's sequence-level
# ratio, cispo's and sapo's own objectives.
CASES = {"trl_defaults": {}, "beta0.04": {"beta": 0.04}, "bnpo_beta0.04": {"loss_type": "bnpo", "beta": 0.04},
         "gspo": {"loss_type": "grpo", "importance_sampling_level": "sequence", "beta": 0.04},
         "dr_grpo": {"loss_type": "dr_grpo"}, "cispo": {"loss_type": "cispo"}, "sapo": {"loss_type": "sapo"}}
METRICS = ("entropy", "kl", "clip_ratio/low_mean", "clip_ratio/high_mean", "cispo_clip_ratio")


@pytest.mark.parametrize("keys", list(CASES.values()), ids=list(CASES))
def test_two_steps_equal_trls_grpo_trainer(tmp_path, keys, monkeypatch):
    folder = str(tmp_path / "hf")
    _folder(folder)
    ours, rollouts, our_grads = _torchmeg(tmp_path, folder, keys)
    theirs, their_grads = _trl(tmp_path, folder, rollouts, keys, monkeypatch)
    assert len(ours) == len(theirs) == 2
    assert len({tuple(r["completion_ids"]) for r in rollouts}) > G  # completions differ: advantages are not 0
    assert len({len(r["completion_ids"]) for r in rollouts}) > 3  # and so do their lengths
    for step, (a, b) in enumerate(zip(ours, theirs), 1):
        assert_close(a["loss"], b["loss"], 1e-5, f"loss at step {step}")
        assert_close(a["grad_norm"], b["grad_norm"], 1e-5, f"grad norm at step {step}")
        shared = [k for k in METRICS if k in b]  # (TRL's kl with beta > 0, its clip metrics per loss type)
        assert shared == [k for k in METRICS if k in a], (shared, sorted(a))
        for key in shared:
            assert_close(a[key], b[key], 1e-5, f"{key} at step {step}")
    assert ours[1]["loss"] != ours[0]["loss"]  # step 2's policy moved off the rollouts' (ratio != 1)
    names = sorted(their_grads)
    assert len(names) == 2 * 9 + 3, names  # every weight of the 2-layer Llama got a gradient
    mapped = {n: next(k for k in our_grads if k.endswith("." + n) or k == n) for n in names}
    ours_flat = torch.cat([our_grads[mapped[n]].flatten() for n in names])
    theirs_flat = torch.cat([their_grads[n].flatten() for n in names])
    gap = ((ours_flat - theirs_flat).norm() / theirs_flat.norm()).item()
    assert gap <= 1e-5, f"the step-2 gradient, all parameters: {gap:.2e} of its norm"
    for n in names:  # each tensor: 1e-4 of its norm (q and k's gradients, ~5e-5 in norm, carry ADAM_EPS's note)
        a, b = our_grads[mapped[n]], their_grads[n]
        assert (a - b).norm() <= 1e-4 * b.norm(), (n, ((a - b).norm() / b.norm()).item())
