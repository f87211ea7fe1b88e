"""GRPO: the loss and its gradient against TRL's GRPOTrainer (the reference), advantages, rollouts by the
serving engine = each sequence generated alone, every layout = one process at every step (rollouts,
rewards, loss), an exact resume, bad input refused in one line."""
from __future__ import annotations

import json
import math
import os
import types
from collections import defaultdict

import pytest
import torch

from conftest import FP32_PARITY, TINY, assert_close, assert_parity, assert_resumed, assert_tensor_close, read_metrics, user_module
from launch import run_cli
from torchmeg.kernels.fused_ce import IGNORE
from torchmeg.train.grpo_loss import GRPOLoss, RolloutRows, advantages, importance_ratio

B, T, V = 6, 7, 11  # rows, completion positions, vocabulary


def _trl_loss(logits, ids, mask, adv, loss_type, beta, eps, eps_high, temperature, old=None, ref=None, is_ratio=None,
              max_completion_length=T, bias_correction_kl=True, **keys):
    """TRL 1.16's GRPOTrainer._compute_loss itself on these logits (a stand-in for its model returns
    TRL's own selective_log_softmax / entropy of logits / temperature; every other input is what its
    trainer would pass, one process, no accumulation) -> the loss."""
    from trl import GRPOTrainer
    from trl.trainer.utils import entropy_from_logits, selective_log_softmax

    def logps_and_entropies(model, input_ids, attention_mask, logits_to_keep, **kw):
        x = logits / temperature
        return selective_log_softmax(x, ids), entropy_from_logits(x), None

    same = lambda t, **kw: t  # noqa: E731  (one process)
    fake = types.SimpleNamespace(
        _get_per_token_logps_and_entropies=logps_and_entropies, top_entropy_quantile=1.0,
        off_policy_mask_threshold=None, importance_sampling_level=keys.get("importance_sampling_level", "token"),
        beta=beta, loss_type=loss_type, get_gamma_weights=GRPOTrainer.get_gamma_weights,
        epsilon_low=eps, epsilon_high=eps_high, use_vllm=is_ratio is not None,
        vllm_importance_sampling_correction=is_ratio is not None, model=types.SimpleNamespace(training=True),
        current_gradient_accumulation_steps=1, max_completion_length=max_completion_length,
        accelerator=types.SimpleNamespace(num_processes=1, gather=same, gather_for_metrics=same, reduce=same,
                                          sync_gradients=True),
        args=types.SimpleNamespace(**{**DEFAULTS, **{k: v for k, v in keys.items() if k in DEFAULTS}},
                                   use_bias_correction_kl=bias_correction_kl, steps_per_generation=1),
        _entropy_bonus_enabled=False, aux_loss_enabled=False, _metrics={"train": defaultdict(list)})
    inputs = {"prompt_ids": torch.zeros(B, 3, dtype=torch.long), "prompt_mask": torch.ones(B, 3),
              "completion_ids": ids, "completion_mask": mask, "advantages": adv, "num_items_in_batch": mask.sum()}
    if old is not None:
        inputs["old_per_token_logps"] = old
    if ref is not None:
        inputs["ref_per_token_logps"] = ref
    if is_ratio is not None:
        inputs["importance_sampling_ratio"] = is_ratio
    return GRPOTrainer._compute_loss(fake, None, inputs), fake._metrics["train"]


def _trl_is_ratio(old, sampling, mask, mode, cap):
    """TRL 1.16's vLLM importance-sampling ratio, as _generate_and_score_completions writes it inline
    (quoted: it is not a function there)."""
    diff = torch.nan_to_num((old - sampling) * mask, nan=0.0)
    diff = diff.sum(dim=-1, keepdim=True) if mode in ["sequence_mask", "sequence_truncate"] else diff
    ratio = torch.exp(diff)
    if mode in ["sequence_truncate", "token_truncate"]:
        return torch.clamp(ratio, min=None, max=cap)
    return ratio.masked_fill((ratio < -math.inf) | (ratio > cap), value=0.0)


def _trl_defaults() -> dict:
    """GRPOConfig's own defaults for the keys its loss reads from `args` (read from TRL, not restated)."""
    import dataclasses
    from trl import GRPOConfig
    names = ("delta", "sapo_temperature_pos", "sapo_temperature_neg", "vespo_k_pos", "vespo_lambda_pos",
             "vespo_k_neg", "vespo_lambda_neg")
    fields = {f.name: f.default for f in dataclasses.fields(GRPOConfig)}
    return {n: fields[n] for n in names}


DEFAULTS = _trl_defaults()

# (loss_type, beta, epsilon_high, old log-probs given (num_iterations > 1), importance sampling, TRL's
# use_bias_correction_kl: its default True unless a case names False; then the other TRL keys a case sets)
CASES = [("grpo", 0.0, 0.2, False, "none", True), ("dr_grpo", 0.0, 0.2, False, "none", True),
         ("dapo", 0.0, 0.28, False, "none", True), ("bnpo", 0.0, 0.2, False, "none", True),
         ("grpo", 0.04, 0.2, True, "none", True), ("dapo", 0.1, 0.28, True, "none", True),
         ("dapo", 0.04, 0.2, False, "none", True), ("grpo", 0.04, 0.2, True, "none", False),
         ("dr_grpo", 0.04, 0.2, True, "token_truncate", True), ("dapo", 0.0, 0.28, True, "token_mask", True),
         ("grpo", 0.0, 0.2, True, "sequence_truncate", True), ("dapo", 0.0, 0.2, False, "sequence_mask", True)]
SEQ = {"importance_sampling_level": "sequence"}
CASES = [c + ({},) for c in CASES] + [
    ("grpo", 0.04, 0.2, True, "none", True, SEQ),                      # GSPO, with a reference
    ("dapo", 0.0, 0.28, True, "token_truncate", True, SEQ),
    ("grpo", 0.04, 0.2, True, "none", True, {"delta": 1.3}),           # two-sided clipping
    ("cispo", 0.0, 0.2, True, "none", True, {}),                       # TRL's default epsilon_high
    ("cispo", 0.04, 5.0, True, "token_mask", True, {}),                # the ScaleRL paper's 5.0
    ("sapo", 0.0, 0.2, True, "none", True, {}),
    ("sapo", 0.04, 0.2, True, "token_truncate", True, {"sapo_temperature_pos": 0.5, "sapo_temperature_neg": 2.0}),
    ("luspo", 0.0, 0.2, True, "none", True, SEQ),
    ("luspo", 0.04, 0.2, True, "none", True, {}),
    ("vespo", 0.0, 0.2, True, "none", True, {}),
    ("vespo", 0.04, 0.2, True, "token_truncate", True, {}),
]


@pytest.mark.parametrize("loss_type, beta, eps_high, with_old, sampling_mode, bias_kl, keys", CASES,
                         ids=["-".join(map(str, c[:6])) + "".join(f"-{k}={v}" for k, v in c[6].items()) for c in CASES])
def test_grpo_loss_and_gradient_equal_trl(loss_type, beta, eps_high, with_old, sampling_mode, bias_kl, keys):
    """The loss and d loss / d logits = TRL's for a fixed batch: completions with padding, old
    log-probs far enough from the current ones that both clip sides engage, a reference, the
    engine's log-probs off by a little (the importance-sampling ratio)."""
    g = torch.Generator().manual_seed(0)
    temperature = 0.7
    logits = torch.randn(B, T, V, generator=g, dtype=torch.float64) * 2
    ids = torch.randint(0, V, (B, T), generator=g)
    lengths = torch.tensor([7, 5, 3, 7, 1, 6])
    mask = (torch.arange(T)[None] < lengths[:, None]).double()
    adv = torch.tensor([1.2, -0.7, 0.3, -1.5, 0.9, 0.0], dtype=torch.float64)
    cur = torch.log_softmax(logits / temperature, -1).gather(-1, ids[..., None])[..., 0]
    old = (cur + 0.3 * torch.randn(B, T, generator=g, dtype=torch.float64)) if with_old else None
    ref = (cur + 0.2 * torch.randn(B, T, generator=g, dtype=torch.float64)) if beta else None
    sampling = (old if with_old else cur) + 0.5 * torch.randn(B, T, generator=g, dtype=torch.float64)
    cap = 1.5
    trl_ratio = None
    if sampling_mode != "none":
        trl_ratio = _trl_is_ratio(old if with_old else cur, sampling, mask, sampling_mode, cap)
        assert_tensor_close(importance_ratio(old if with_old else cur, sampling, mask, sampling_mode, cap), trl_ratio,
                            1e-12, "importance ratio")

    x1 = logits.clone().requires_grad_(True)
    want, trl_metrics = _trl_loss(x1, ids, mask, adv, loss_type, beta, 0.2, eps_high, temperature, old, ref, trl_ratio,
                                  bias_correction_kl=bias_kl, **keys)
    want.backward()

    # torchmeg's rows: a completion's token k is the target at position k (IGNORE past its end)
    labels = ids.masked_fill(mask == 0, IGNORE)
    k = {**DEFAULTS, **keys}
    loss_fn = GRPOLoss(loss_type, beta, 0.2, eps_high, temperature, T, sampling_mode, cap, bias_correction_kl=bias_kl,
                       level=keys.get("importance_sampling_level", "token"), delta=k["delta"] or 0.0,
                       sapo=(k["sapo_temperature_pos"], k["sapo_temperature_neg"]),
                       vespo=(k["vespo_k_pos"], k["vespo_lambda_pos"], k["vespo_k_neg"], k["vespo_lambda_neg"]))
    loss_fn.token_scale = 1.0 / mask.sum().item()  # dapo: one rank, one microbatch: 1 / the batch's tokens
    loss_fn.see((None, None, RolloutRows(adv, sampling, old, ref)))
    x2 = logits.clone().requires_grad_(True)
    got = loss_fn(x2, labels)
    got.backward()
    assert_close(got.item(), want.item(), 1e-9, f"{loss_type} loss vs TRL")  # fp64: both exact to ~1e-15
    assert_tensor_close(x2.grad, x1.grad, 1e-9, f"{loss_type} d loss / d logits vs TRL")
    assert x1.grad.abs().max() > 0
    ours = loss_fn.step_metrics(None)  # (one process: its all-reduces are the identity)
    names = [m for m in trl_metrics if m in ("entropy", "kl", "cispo_clip_ratio") or m.endswith("_mean")
             and m.startswith("clip_ratio/")]
    assert set(names) <= set(ours) and (("kl" in names) == bool(beta)), (sorted(trl_metrics), sorted(ours))
    for m in names:
        assert_close(ours[m], trl_metrics[m][-1], 1e-6, f"{m} vs TRL")
    if loss_type in ("grpo", "cispo") and eps_high < 1 and with_old and not keys.get("importance_sampling_level"):  # (the clip
        # engages: the metric is not a trivial 0 = 0; per completion the mean log-ratio stays inside the range)
        assert max(ours.get("clip_ratio/region_mean", 0), ours.get("cispo_clip_ratio", 0)) > 0, ours


def _nanstd(x):
    x = [v for v in x if not math.isnan(v)]
    m = sum(x) / len(x)
    return math.sqrt(sum((v - m) ** 2 for v in x) / (len(x) - 1))


@pytest.mark.parametrize("scale", ["group", "batch", "none"])
def test_advantages_as_trl_computes_them(scale):
    """Two functions, weights 1 and 0.5, one None (NaN) and one completion no function scores (zero
    advantage, out of its group's mean); groups of 3."""
    nan = float("nan")
    r = torch.tensor([[1.0, 0.0], [0.0, 1.0], [nan, nan], [0.5, nan], [0.5, 0.0], [0.5, 0.2]], dtype=torch.float64)
    adv, summed, zero = advantages(r, torch.tensor([1.0, 0.5], dtype=torch.float64), 3, scale)
    rewards = [1.0, 0.5, nan, 0.5, 0.5, 0.6]
    assert math.isnan(summed[2]) and summed.tolist()[:2] == [1.0, 0.5]
    g1, g2 = rewards[:3], rewards[3:]
    m1, m2 = 0.75, (0.5 + 0.5 + 0.6) / 3
    sd = {"group": [_nanstd(g1)] * 3 + [_nanstd(g2)] * 3, "batch": [_nanstd(rewards)] * 6}.get(scale)
    for i, (x, m) in enumerate(zip(rewards, [m1] * 3 + [m2] * 3)):
        want = 0.0 if math.isnan(x) else (x - m) / (sd[i] + 1e-4 if sd else 1.0)
        assert abs(adv[i].item() - want) < 1e-12, (i, adv[i].item(), want)
    assert not zero.any()
    _, _, zero = advantages(torch.ones(6, 1, dtype=torch.float64), torch.ones(1, dtype=torch.float64), 3, scale)
    assert zero.all()


# ---- runs -------------------------------------------------------------------------------------------

def _rewards_env(tmp_path) -> dict:
    """PYTHONPATH with a user's reward module, written as for TRL: a function of completions and a
    column (conftest.user_module: one folder for the test run, so one fork server for these runs)."""
    folder = user_module(tmp_path, "my_rewards.py",
                         "def length(completions, completion_ids, **kwargs):\n"
                         "    return [min(len(i), 16) / 16 if len(i) % 5 else None for i in completion_ids]\n"
                         "def text(completions, **kwargs):\n"
                         "    return ['good' for _ in completions]\n"
                         "def boom(completions, **kwargs):\n"
                         "    raise KeyError('answer')\n")
    return {"PYTHONPATH": folder + os.pathsep + os.environ.get("PYTHONPATH", "")}


GRPO = [a for a in TINY if not a.startswith(("--data.seq_len", "--validation", "--training.local_batch_size"))] + [
    "--training.objective=grpo", "--data.dataset=python_stdlib_names", "--data.chat_template=chatml",
    "--data.seq_len=352", "--grpo.max_prompt_length=320", "--grpo.max_completion_length=24",
    "--grpo.num_generations=4", "--training.global_batch_size=8", "--training.local_batch_size=2",
    "--validation.enable=false", "--training.deterministic=true", "--optimizer.lr=3e-3", "--training.steps=3",
    "--grpo.log_completions=true", '--grpo.reward_funcs=["torchmeg.data.name_task:signature_reward","my_rewards:length"]',
    "--grpo.reward_weights=[1.0,0.5]"]
P = "--parallelism."
ROLLOUT_KEYS = ("reward", "reward_std", "rewards/signature_reward/mean", "rewards/length/mean", "completions/mean_length",
                "frac_reward_zero_std")


def _completions(d, name="run"):
    with open(os.path.join(d, name, "completions.jsonl")) as fh:
        return [json.loads(line) for line in fh]


def _launch(tmp_path, extra, nproc=1, name="run"):
    return run_cli(GRPO + extra, tmp_path, nproc=nproc, name=name, env=_rewards_env(tmp_path), timeout=180)


def _run(tmp_path, extra, nproc=1, name="run"):
    _launch(tmp_path, extra, nproc, name)
    return read_metrics(tmp_path, name), _completions(tmp_path, name)


@pytest.fixture(scope="module")
def one_process(tmp_path_factory):
    d = tmp_path_factory.mktemp("grpo_ref")
    return _run(d, ["--grpo.num_iterations=1", "--grpo.beta=0.04"])


@pytest.mark.slow
@pytest.mark.parametrize("layout, nproc", [(["--parallelism.data_parallel_shard_degree=2"], 2),
                                           ([P + "tensor_parallel_degree=2"], 2),
                                           ([P + "tensor_parallel_degree=2", P + "data_parallel_shard_degree=2"], 4)],
                         ids=["fsdp2", "tp2", "tp2xfsdp2"])
def test_layouts_equal_one_process(one_process, tmp_path, layout, nproc):
    """Rollouts (every token of every completion), rewards and advantages identical, loss and grad
    norm within fp32 parity, at every step, with the KL to a reference on."""
    ref_metrics, ref_rollouts = one_process
    metrics, rollouts = _run(tmp_path, ["--grpo.num_iterations=1", "--grpo.beta=0.04"] + layout, nproc=nproc)
    assert [(r["step"], r["row"], r["completion_ids"], r["rewards"]) for r in rollouts] == \
        [(r["step"], r["row"], r["completion_ids"], r["rewards"]) for r in ref_rollouts]
    assert len(ref_rollouts) == 3 * 8 and len({tuple(r["completion_ids"]) for r in ref_rollouts}) > 12
    for a, b in zip(ref_rollouts, rollouts):
        assert abs(a["advantage"] - b["advantage"]) < 1e-9
    assert_parity(ref_metrics, metrics, keys=("loss", "grad_norm", "kl", "entropy") + ROLLOUT_KEYS)
    assert any(r["loss"] != 0 for r in ref_metrics) and ref_metrics[-1]["kl"] > 0  # (the policy moved off the reference)


@pytest.mark.slow
def test_resume_is_exact_and_iterations_reuse_rollouts(tmp_path):
    """num_iterations 2: steps 1-2 train on one batch of rollouts (step 2's ratio moves off 1 and
    clips), 3-4 on the next; a run stopped after step 2 and resumed = the run straight through."""
    args = ["--grpo.num_iterations=2", "--training.steps=4", "--checkpoint.enable=true", "--checkpoint.interval=2",
            "--grpo.epsilon=0.02"]
    straight, rolled = _run(tmp_path, args, name="straight")
    _run(tmp_path, args + ["--training.steps=2"], name="resumed")
    assert_resumed(_launch(tmp_path, args, name="resumed"), 2)
    resumed, rolled2 = read_metrics(tmp_path, "resumed"), _completions(tmp_path, "resumed")
    assert [r["step"] for r in rolled] == [1] * 8 + [3] * 8  # rollouts at steps 1 and 3 only
    assert [(r["step"], r["completion_ids"]) for r in rolled2] == [(r["step"], r["completion_ids"]) for r in rolled]
    assert_parity(straight, resumed, keys=("loss", "grad_norm") + ROLLOUT_KEYS, steps=[3, 4])
    assert straight[1]["clip_ratio/region_mean"] > 0 and straight[0]["clip_ratio/region_mean"] == 0


def test_rollouts_are_each_sequence_generated_alone(tmp_path):
    """The engine's rollouts (continuous batching, packed prefill, a group's prompt computed once) =
    torchmeg.batching.generation.generate of each prompt alone with the same seed and sample index:
    per-sequence seeds, no batch effect."""
    from torchmeg.data.chat import ChatTemplate
    from torchmeg.data.tokenizer import build_tokenizer
    from torchmeg.batching.generation import Sampling, generate as generate_alone
    from torchmeg.models.args import instantiate
    from torchmeg.models.spec import get_spec
    from torchmeg.train.grpo import stop_tokens
    from torchmeg.train.rollout import generate
    from torchmeg.config.schema import load_config
    from torchmeg.models.args import model_args
    cfg = load_config("recipes/grpo_debug.toml", [])
    torch.manual_seed(0)
    model = instantiate(get_spec("llama"), model_args(cfg, 320), "cpu")
    tok, template = build_tokenizer("byte"), ChatTemplate.load("chatml")
    eos, stops = stop_tokens(tok, template)
    assert stops == ("<|im_end|>",)  # the byte tokenizer writes the end of turn in bytes: a stop string
    prompts = [list(template.render([{"role": "user", "content": q}], add_generation_prompt=True).encode())
               for q in ("How do I call `json.loads`?", "How do I call `re.sub`?")]
    rows = [prompts[i // 3] for i in range(6)]
    s = Sampling(temperature=1.0, seed=7)
    outs, timing = generate(model, tok, torch.device("cpu"), rows, list(range(6)), s, 20, eos, stops)
    assert timing["tokens"] == sum(len(o.completion) for o in outs)
    # each group's prompt computed once: its 2 other completions copy it (whole 16-token blocks, the
    # last token left to compute); the second group's first copies the template's header the two share
    blocks = lambda n: n // 16 * 16  # noqa: E731
    shared = len(os.path.commonprefix(prompts))
    assert timing["prompt_tokens"] == sum(map(len, rows)) and shared >= 16
    assert timing["cached_prompt_tokens"] == sum(2 * blocks(len(p) - 1) for p in prompts) + blocks(shared)
    for i, o in enumerate(outs):
        alone = generate_alone(model, [rows[i]], 20, -1, s, "cpu", sample_index=i)[0]
        assert o.completion == alone.tokens[:len(o.completion)]
        assert len(o.logps) == len(o.completion)
    assert len({tuple(o.completion) for o in outs[:3]}) == 3  # a group's sample indices differ


@pytest.mark.slow
def test_bad_input_each_one_line(tmp_path):
    """Unknown reward function, a reward returning a string, one that raises, a prompt longer than the
    context, an empty prompt set: exit 2 with one line naming the key, function or record."""
    env = _rewards_env(tmp_path)
    empty = tmp_path / "empty.jsonl"
    empty.write_text("\n")
    long = tmp_path / "long.jsonl"
    long.write_text(json.dumps({"prompt": "x" * 40}) + "\n" + json.dumps({"prompt": "y" * 340, "answer": "1"}) + "\n")
    cases = [
        (['--grpo.reward_funcs=["my_rewards:nope"]', "--grpo.reward_weights=[]"], "grpo.reward_funcs: 'my_rewards:nope': my_rewards has no function 'nope'"),
        (['--grpo.reward_funcs=["no_such_module:f"]', "--grpo.reward_weights=[]"], "module 'no_such_module' cannot be imported"),
        (['--grpo.reward_funcs=["my_rewards:text"]', "--grpo.reward_weights=[]"], "reward function 'text' returned 'good' (str) for completion 0"),
        (['--grpo.reward_funcs=["my_rewards:boom"]', "--grpo.reward_weights=[]"], "reward function 'boom' raised KeyError: 'answer'"),
        ([f"--data.dataset={long}"], f"{long}:2: its prompt (340 tokens) + grpo.max_completion_length 24 exceed data.seq_len 352"),
        ([f"--data.dataset={empty}"], f"{empty}: no prompts"),
        (["--training.global_batch_size=6", "--training.local_batch_size=3"], "a whole number of groups of grpo.num_generations = 4"),
    ]
    for extra, want in cases:
        p = run_cli(GRPO + extra + ["--grpo.max_prompt_length=400", "--training.steps=1"], tmp_path, check=False,
                    env=env, timeout=120)
        lines = [x for x in p.stderr.strip().splitlines() if x.strip()]
        assert p.returncode == 2 and len(lines) == 1 and want in lines[0], (extra, p.returncode, p.stderr[-2000:])
    # met during a run by every rank of an FSDP2 job: each says it in one line, the job exits 2 in seconds
    p = run_cli(GRPO + ['--grpo.reward_funcs=["my_rewards:boom"]', "--grpo.reward_weights=[]", "--training.steps=1",
                        "--parallelism.data_parallel_shard_degree=2"], tmp_path, nproc=2, check=False, env=env,
                timeout=120)
    lines = [x for x in p.stderr.strip().splitlines() if x.strip()]
    assert p.returncode == 2 and lines and all("reward function 'boom' raised KeyError" in x for x in lines), p.stderr[-2000:]


def test_the_watchdog_times_rollouts_apart_from_the_step():
    """Rollouts run inside a step under their own phase and limit; the step's clock resumes after
    them without their time (the median a hang is judged by is of training steps)."""
    import time as _time
    from torchmeg.config.schema import load_config
    from torchmeg.runtime.guard import Watchdog
    w = Watchdog(load_config(None, ["--training.watchdog_factor=0"]), 0)
    w.begin("step 1")
    with w.inside("rollouts for step 1"):
        assert w._phase == "rollouts for step 1"
        _time.sleep(0.3)
    assert w._phase == "step 1"
    w.end()
    assert len(w._times) == 1 and w._times[0] < 0.25


@pytest.mark.slow
@pytest.mark.parametrize("lora", [True, False], ids=["lora", "full_weights"])
def test_lora_recompute_bf16_with_a_reference_and_iterations(tmp_path, lora):
    """LoRA adapters or not, full recompute and bf16 (FSDP's mixed precision on one rank) with beta > 0
    and num_iterations 2: the reference's forward after the old policy's (which leaves FSDP's root
    unsharded) runs — under LoRA the base with the adapters off, without it the copy swapped in — and
    the KL is logged."""
    metrics, rolled = _run(tmp_path, [f"--lora.enable={str(lora).lower()}", "--activation_checkpoint.mode=full",
                                      "--training.mixed_precision=bf16", "--grpo.beta=0.1", "--grpo.num_iterations=2",
                                      "--training.steps=4"])
    assert [m["step"] for m in metrics] == [1, 2, 3, 4] and all("kl" in m for m in metrics)
    assert metrics[-1]["kl"] > 0 and len(rolled) == 2 * 8


@pytest.mark.slow
def test_moe_router_load_counts_training_tokens_only(tmp_path):
    """A MoE policy: the rollouts' routing is not training load (the load-balancing bias and the
    logged tokens per expert count the step's training rows only: rows x seq_len x top_k x the one
    MoE layer of moe/debug cut to TINY's 2 layers, the first dense)."""
    metrics, _ = _run(tmp_path, ["--model.name=moe", "--model.flavor=debug", "--training.steps=2"])
    rows, seq_len, top_k, moe_layers = 8, 352, 2, 1
    for m in metrics:
        assert sum(m["tokens_per_expert"]) == rows * seq_len * top_k * moe_layers, m["tokens_per_expert"]


@pytest.mark.slow
def test_a_resume_keeps_the_reference_of_the_start_with_lora(tmp_path):
    """beta > 0 with LoRA from a base checkpoint: a run stopped after step 2 and resumed = the run
    straight through (loss, KL). The reference is the base with the adapters off, before and after the
    resume: the trained adapters must not enter it."""
    run_cli(TINY + ["--checkpoint.enable=true", "--checkpoint.interval=2", "--training.steps=2",
                    "--validation.enable=false"], tmp_path, name="base")
    args = ["--lora.enable=true", "--grpo.beta=0.1", "--training.steps=4", "--checkpoint.enable=true",
            "--checkpoint.interval=2", f"--checkpoint.initial_load_path={tmp_path / 'base' / 'checkpoint'}"]
    straight, _ = _run(tmp_path, args, name="straight")
    _run(tmp_path, args + ["--training.steps=2"], name="resumed")
    assert_resumed(_launch(tmp_path, args, name="resumed"), 2)
    resumed = read_metrics(tmp_path, "resumed")
    assert straight[-1]["kl"] > 0
    assert_parity(straight, resumed, keys=("loss", "grad_norm", "kl"), steps=[3, 4])


def test_prompts_are_tokenized_as_trl_tokenizes_them(tmp_path):
    """A standard prompt is tokenized as the tokenizer is configured (a Llama-3 style tokenizer.json
    whose post-processor adds a BOS: transformers' `tokenizer(text)`, what TRL feeds its model); a
    conversational one as apply_chat_template renders and tokenizes it (specials as text, none added).
    Every column of the set reaches the reward functions, None where a record lacks it (as TRL's
    datasets give it): a missing column no longer shifts the next records' values onto this one's."""
    from tokenizers import Tokenizer, processors
    from transformers import PreTrainedTokenizerFast

    from conftest import byte_level_bpe
    from torchmeg.data.chat import ChatTemplate
    from torchmeg.data.prompts import PromptSet
    from torchmeg.data.tokenizer import HFTokenizer
    path = tmp_path / "tokenizer.json"
    byte_level_bpe(path, 400, ["<|begin_of_text|>", "<|end_of_text|>", "<|im_start|>", "<|im_end|>"])
    tok = Tokenizer.from_file(str(path))
    bos = tok.token_to_id("<|begin_of_text|>")
    tok.post_processor = processors.TemplateProcessing(single="<|begin_of_text|> $A",
                                                       special_tokens=[("<|begin_of_text|>", bos)])
    tok.save(str(path))
    records = [{"prompt": "What does json.loads do?", "answer": "parse"}, {"prompt": "Name a textwrap function."},
               {"messages": [{"role": "user", "content": "Say hi."}], "answer": "hi", "level": 2}]
    (tmp_path / "p.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    template = ChatTemplate.load("chatml")
    ps = PromptSet([str(tmp_path / "p.jsonl")], HFTokenizer(str(path)), template, 100, 200, 8, 0)
    hf = PreTrainedTokenizerFast(tokenizer_file=str(path))
    for item, r in zip(ps.items[:2], records):
        assert item.ids == hf(r["prompt"])["input_ids"] and item.ids[0] == bos, (item.ids, r)
    rendered = template.render(records[2]["messages"], add_generation_prompt=True)
    assert ps.items[2].ids == hf(rendered, add_special_tokens=False)["input_ids"]
    assert ps.columns == ["answer", "level"]
    assert [p.columns.get("answer") for p in ps.items] == ["parse", None, "hi"]


def test_a_reward_that_is_not_finite_is_one_line_naming_function_and_step():
    """NaN trained on silently (reward nan, gradient 0) and an inf zeroed its group's advantages: both
    are refused with the function, the completion and the step named; None stays "does not apply"."""
    from torchmeg.train.rewards import RewardError, call_rewards

    def make(v):
        return lambda prompts, completions, **kw: [1.0, v]

    assert math.isnan(call_rewards([("ok", make(None))], ["p", "p"], ["a", "b"], [[1], [2]], {}, 3)[1][0])
    for bad in (float("nan"), float("inf"), -float("inf")):
        with pytest.raises(RewardError, match=r"^reward function 'acc' returned (nan|inf|-inf) for completion 1 at "
                                              r"step 3; a reward is a finite float, or None where it does not apply$"):
            call_rewards([("acc", make(bad))], ["p", "p"], ["a", "b"], [[1], [2]], {}, 3)
