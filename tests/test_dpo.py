"""DPO: the loss and rewards against TRL's DPOTrainer (the reference), layouts = one process, a debug run
that learns the preference, the reference log-probs kept across a resume, bad pairs refused."""
from __future__ import annotations

import json
import types
from collections import defaultdict

import pytest
import torch

from conftest import FP32_PARITY, TINY, assert_close, assert_parity, assert_resumed, read_metrics, reference_run
from launch import run_cli

DPO = TINY + ["--training.objective=dpo", "--data.dataset=python_stdlib_pairs", "--data.chat_template=chatml",
              "--data.seq_len=384", "--training.steps=4", "--training.deterministic=true",
              "--training.global_batch_size=4", "--optimizer.lr=1e-3", "--checkpoint.enable=true",
              "--checkpoint.interval=2"]
P = "--parallelism."
# A reward is beta x (policy log-prob - reference log-prob) of a row: a difference of two sums of up to
# seq_len per-token terms of size up to ln(vocab) (5.77 for the byte tokenizer's 320), each summed in
# fp32 in an order that depends on the layout: at most seq_len x ln(vocab) x 2^-24 ~ 1.3e-4 apart per
# sum, so beta x 2 x that ~ 2.6e-5 apart per reward, whatever the reward's own size (0.01-0.1 here,
# where relative bounds would test cancellation, not the layout). A reward averaged per rank instead
# of over the global batch moves by the rewards' spread, ~1e-2.
REWARD_ABS = 0.1 * 2 * 384 * 5.77 * 2 ** -24


def _trl_loss(per_token_logps, completion_mask, ref, beta, loss_types, weights, smoothing=0.0):
    """TRL's DPOTrainer._compute_loss itself, on these per-token log-probs (a stand-in model returns
    them; every other input is what its trainer would pass) -> (loss, its logged metrics)."""
    from trl import DPOTrainer
    rows, L = completion_mask.shape
    zeros = torch.zeros(rows, L - 1)
    outputs = types.SimpleNamespace(log_probs=per_token_logps, entropy=zeros, mean_logits=zeros,
                                    is_top1=torch.zeros(rows, L - 1, dtype=torch.bool))
    model = types.SimpleNamespace(training=True)
    gather = lambda t: t  # noqa: E731  (one process)
    fake = types.SimpleNamespace(
        model=model, accelerator=types.SimpleNamespace(device="cpu", gather=gather, gather_for_metrics=gather),
        aux_loss_enabled=False, ld_alpha=None, precompute_ref_logps=True, f_divergence_type="reverse_kl",
        loss_types=loss_types, loss_weights=weights, beta=beta, label_smoothing=smoothing, use_weighting=False,
        _metrics={"train": defaultdict(list)}, _total_train_tokens=0, _tp_size=1)
    inputs = {"input_ids": torch.zeros(rows, L, dtype=torch.long), "attention_mask": torch.ones(rows, L),
              "completion_mask": completion_mask, "ref_chosen_logps": ref[:, 0], "ref_rejected_logps": ref[:, 1]}
    loss = DPOTrainer._compute_loss(fake, lambda **kw: outputs, inputs, return_outputs=False)
    return loss.item(), {k: v[-1] for k, v in fake._metrics["train"].items()}


# (training.dpo_loss_type, dpo.loss_weights, dpo.label_smoothing): every type alone, RPO's sigmoid + sft
DPO_LOSSES = [(k, [], 0.1 if k == "robust" else 1e-3 if k == "exo_pair" else 0.0)
              for k in ("sigmoid", "ipo", "hinge", "robust", "exo_pair", "apo_zero", "apo_down", "bco_pair", "nca_pair",
                        "sppo_hard", "sigmoid_norm")] + [("sigmoid,sft", [1.0, 0.5], 0.0), ("ipo,sft", [], 0.0)]


@pytest.mark.parametrize("loss_type, weights, smoothing", DPO_LOSSES, ids=[c[0] for c in DPO_LOSSES])
def test_dpo_loss_and_rewards_equal_trl(loss_type, weights, smoothing):
    from torchmeg.kernels.fused_ce import IGNORE
    from torchmeg.train.dpo import DPOLoss
    g = torch.Generator().manual_seed(0)
    pairs, L, V, beta = 6, 24, 50, 0.1
    rows = 2 * pairs
    logits = torch.randn(rows, L, V, generator=g, dtype=torch.float64) * 3
    ids = torch.randint(0, V, (rows, L), generator=g)
    mask = torch.zeros(rows, L)
    for r in range(rows):  # answers of different lengths after prompts of different lengths
        start = int(torch.randint(3, 10, (1,), generator=g))
        mask[r, start:start + int(torch.randint(4, L - start, (1,), generator=g))] = 1
    labels = torch.where(mask[:, 1:] > 0, ids[:, 1:], torch.full_like(ids[:, 1:], IGNORE))
    labels = torch.cat([labels, torch.full((rows, 1), IGNORE)], 1)  # torchmeg's [rows, L]: position t predicts t + 1
    logp = torch.log_softmax(logits, -1)[:, :-1].gather(-1, ids[:, 1:, None])[..., 0] * mask[:, 1:]
    ref = torch.randn(pairs, 2, generator=g, dtype=torch.float64) * 5 + logp.sum(-1).view(pairs, 2)
    # TRL's batch is [all chosen; all rejected]; torchmeg's interleaves a pair's rows
    order = torch.cat([torch.arange(0, rows, 2), torch.arange(1, rows, 2)])
    kinds = loss_type.split(",")
    want, metrics = _trl_loss(logp[order], mask[order], ref, beta, kinds, weights or [1.0] * len(kinds), smoothing)
    ours = DPOLoss(beta, list(zip(kinds, weights or [1.0] * len(kinds))), smoothing)
    ours.table, ours.pair_ids = ref, torch.arange(pairs)
    ours.sft_scale = 1 / float((labels[0::2] != IGNORE).sum())  # count_targets' value at one rank, one microbatch
    with torch.enable_grad():
        got = ours(logits, labels).item()
    # float64 on both sides (torchmeg keeps float64 logits in float64): only summation order differs,
    # ~1e-16 relative per operation, far inside the 1e-6 asked
    assert_close(got, want, 1e-6, f"{loss_type} loss vs TRL")
    s = ours.sums  # the step's sums (step_metrics all-reduces them over the loss group)
    n = s[3].item()
    assert_close(s[0].item() / n, metrics["rewards/chosen"], 1e-6, "rewards/chosen")
    assert_close(s[1].item() / n, metrics["rewards/rejected"], 1e-6, "rewards/rejected")
    assert_close(s[0].item() / n - s[1].item() / n, metrics["rewards/margins"], 1e-6, "rewards/margins")
    assert_close(s[2].item() / n, metrics["rewards/accuracies"], 1e-6, "rewards/accuracies")  # (TRL: a float32 mean)


@pytest.fixture(scope="module")
def dpo_reference(tmp_path_factory):
    return reference_run(tmp_path_factory, DPO + ["--training.local_batch_size=4"])


@pytest.mark.slow
@pytest.mark.parametrize("name, ranks, local, layout", [
    ("fsdp2", 2, 2, [P + "data_parallel_shard_degree=2"]),
    ("fsdp2_accum2", 2, 1, [P + "data_parallel_shard_degree=2"]),
    ("tp2", 2, 4, [P + "tensor_parallel_degree=2", P + "data_parallel_shard_degree=1"]),
    ("tp2_fsdp2", 4, 2, [P + "tensor_parallel_degree=2", P + "data_parallel_shard_degree=2"]),
])
def test_dpo_layout_matches_one_process(name, ranks, local, layout, tmp_path, dpo_reference):
    """Loss, grad norm, val loss and the reward metrics of every step, the reference log-probs
    computed in the layout itself (each dp rank a share)."""
    p = run_cli(DPO + [f"--training.local_batch_size={local}"] + layout, tmp_path, nproc=ranks)
    got = read_metrics(tmp_path)
    assert_parity(dpo_reference, got)
    for a, b in zip(dpo_reference, got):
        for k in ("dpo_rewards_chosen", "dpo_rewards_rejected"):
            assert abs(a[k] - b[k]) <= REWARD_ABS, (a["step"], k, a[k], b[k])
        assert a["dpo_accuracy"] == b["dpo_accuracy"], (a["step"], a["dpo_accuracy"], b["dpo_accuracy"])
    assert "reference log-probs of" in p.stdout


@pytest.mark.slow
def test_dpo_resume_reads_the_reference_back(tmp_path, dpo_reference):
    """Stopped after step 2 and resumed: the same metrics as the uninterrupted run (the reference
    log-probs read back, not recomputed from trained weights); without them, one line."""
    run_cli(DPO + ["--training.local_batch_size=4", "--training.steps=2"], tmp_path)
    p = run_cli(DPO + ["--training.local_batch_size=4"], tmp_path)
    assert_resumed(p, 2)
    assert "reference log-probs read from" in p.stdout
    assert_parity(dpo_reference, read_metrics(tmp_path)[-2:], steps={3, 4})
    (tmp_path / "run" / "checkpoint" / "dpo_reference.pt").unlink()
    p = run_cli(DPO + ["--training.local_batch_size=4", "--training.steps=6"], tmp_path, check=False)
    errors = [x for x in p.stderr.splitlines() if x.strip()]
    assert p.returncode != 0 and "dpo_reference.pt" in errors[-1] and "start the run anew" in errors[-1], p.stderr[-2000:]


@pytest.mark.slow
def test_dpo_debug_run_raises_margin_and_accuracy(tmp_path):
    """Fresh pairs every step (measured before each update: how the model generalises): the margin
    and the accuracy of the last five steps above those of steps 2-6 (measured: margin 0.21 -> 0.87,
    accuracy 0.95 -> 1.0), validation below log 2."""
    run_cli(DPO + ["--training.local_batch_size=4", "--training.steps=20", "--checkpoint.enable=false",
                   "--lr_scheduler.warmup_steps=3", "--optimizer.lr=2e-4"], tmp_path)
    rows = read_metrics(tmp_path)
    first, last = rows[1:6], rows[-5:]  # (step 1: policy = reference, margin 0)
    mean = lambda rs, k: sum(r[k] for r in rs) / len(rs)  # noqa: E731
    assert rows[0]["dpo_margin"] == 0.0 and rows[0]["loss"] == pytest.approx(0.6931, abs=1e-4)  # log 2
    assert mean(last, "dpo_margin") > mean(first, "dpo_margin") + 0.3, rows
    assert mean(last, "dpo_accuracy") >= mean(first, "dpo_accuracy") and mean(last, "dpo_accuracy") >= 0.9, rows
    assert rows[-1]["val_loss"] < 0.6931


@pytest.mark.slow
def test_a_reference_checkpoint_changes_the_loss_as_trls_ref_model(tmp_path):
    """dpo.reference_path: the reference log-probs come from that checkpoint (= those a run starting
    from it computes), the policy is still the starting weights (put back after the reference pass),
    and step 1's loss and rewards are TRL's with ref_model = that checkpoint. Four pairs, global batch
    4, lr 0: step 1 sees every pair. A resume with another reference is refused in one line."""
    run_cli(TINY + ["--checkpoint.enable=true", "--checkpoint.interval=1", "--training.steps=3", "--checkpoint.keep_latest_k=0",
                    "--optimizer.lr=3e-3"], tmp_path, name="src")
    src = tmp_path / "src" / "checkpoint"
    pairs = tmp_path / "pairs.jsonl"
    pairs.write_text("".join(json.dumps({"prompt": f"Say {w}.", "chosen": f"{w}, indeed.", "rejected": "no"}) + "\n"
                             for w in ("a", "yes", "42", "end")))
    base = TINY + ["--training.objective=dpo", f"--data.dataset={pairs}", "--data.chat_template=chatml",
                   "--data.seq_len=64", "--data.val_fraction=0", "--validation.enable=false", "--optimizer.lr=0",
                   "--training.global_batch_size=4", "--training.local_batch_size=4", "--training.steps=1",
                   "--checkpoint.enable=true", "--checkpoint.interval=1"]
    start, ref = src / "step-00000003", src / "step-00000001"
    p = run_cli(base + [f"--checkpoint.initial_load_path={start}", f"--dpo.reference_path={ref}"], tmp_path, name="x")
    assert f"computed from {ref}" in p.stdout, p.stdout[-2000:]
    run_cli(base + [f"--checkpoint.initial_load_path={ref}"], tmp_path, name="r")       # its log-probs as a start
    run_cli(base + [f"--checkpoint.initial_load_path={start}"], tmp_path, name="s")     # the policy's
    table = lambda n: torch.load(tmp_path / n / "checkpoint" / "dpo_reference.pt")["table"]  # noqa: E731
    assert torch.equal(table("x"), table("r")) and not torch.equal(table("x"), table("s"))
    policy, reference = table("s"), table("x")
    # TRL's batch [4 chosen; 4 rejected], each row's summed log-prob as its one completion token
    logp = torch.cat([policy[:, 0], policy[:, 1]])[:, None]
    want, metrics = _trl_loss(logp, torch.tensor([[0.0, 1.0]] * 8), reference, 0.1, ["sigmoid"], [1.0])
    got = read_metrics(tmp_path, "x")[0]
    assert_close(got["loss"], want, 1e-5, "step-1 loss vs TRL with ref_model")  # fp32 log-probs of 64-token rows
    assert abs(got["dpo_margin"] - metrics["rewards/margins"]) <= REWARD_ABS and abs(got["dpo_margin"]) > 10 * REWARD_ABS
    # FSDP2 (weights swapped in and out of sharded parameters): the same loss, margins and grad norm
    run_cli(base + [f"--checkpoint.initial_load_path={start}", f"--dpo.reference_path={ref}",
                    "--parallelism.data_parallel_shard_degree=2", "--training.local_batch_size=2"], tmp_path, nproc=2,
            name="x2")
    assert_parity(read_metrics(tmp_path, "x"), read_metrics(tmp_path, "x2"), keys=("loss", "grad_norm", "dpo_margin"))
    p = run_cli(base + [f"--checkpoint.initial_load_path={start}", f"--dpo.reference_path={src / 'step-00000002'}",
                        "--training.steps=2"], tmp_path, name="x", check=False)
    errors = [x for x in p.stderr.splitlines() if x.strip()]
    assert p.returncode == 2 and len(errors) == 1 and "dpo.reference_path" in errors[0], p.stderr[-2000:]


BAD_PAIRS = {
    "no rejected": ('{"prompt": "hi", "chosen": "hello"}', "no 'rejected'"),
    "empty chosen": ('{"prompt": "hi", "chosen": " ", "rejected": "x"}', "'chosen' must be a non-empty"),
    "mixed implicit": ('{"chosen": [{"role": "user", "content": "a"}], "rejected": "b"}', "must both be conversations"),
    "text prompt, message answer": ('{"prompt": "hi", "chosen": [{"role": "assistant", "content": "x"}], '
                                    '"rejected": "y"}', "must be a non-empty string beside a text prompt"),
    "empty conversational answer": ('{"prompt": [{"role": "user", "content": "hi"}], "chosen": [], "rejected": "y"}',
                                    "'chosen' must be a non-empty answer"),
    "not json": ('{"prompt": ', "not JSON"),
}


@pytest.mark.slow
@pytest.mark.parametrize("case", list(BAD_PAIRS))
def test_bad_pair_is_refused_in_one_line_naming_file_and_line(case, tmp_path):
    line, why = BAD_PAIRS[case]
    good = json.dumps({"prompt": "Say hi.", "chosen": "Hi!", "rejected": "No."})
    path = tmp_path / "pairs.jsonl"
    path.write_text(good + "\n" + line + "\n")
    p = run_cli(TINY + ["--training.objective=dpo", f"--data.dataset={path}", "--data.chat_template=chatml",
                        "--data.seq_len=64"], tmp_path, check=False)
    errors = [x for x in p.stderr.splitlines() if x.strip()]
    assert p.returncode == 2 and len(errors) == 1 and f"{path}:2" in errors[0] and why in errors[0], p.stderr[-2000:]


@pytest.mark.slow
def test_dpo_layouts_it_does_not_take_are_refused(tmp_path):
    for extra, key in (([P + "pipeline_parallel_degree=2"], "pipeline_parallel_degree"),
                       (["--training.fused_linear_cross_entropy=true"], "fused_linear_cross_entropy"),
                       (["--data.document_masking=true"], "document_masking")):
        p = run_cli(DPO + extra, tmp_path, check=False, nproc=2 if "pipeline" in key else 1)
        assert p.returncode == 2 and key in p.stderr and "dpo" in p.stderr, p.stderr[-2000:]


def test_pairs_from_parquet_equal_jsonl_and_only_the_answer_is_a_target(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq
    from torchmeg.data.chat import ChatTemplate
    from torchmeg.data.pairs import Pairs
    from torchmeg.data.tokenizer import ByteTokenizer
    records = [{"prompt": "Say hi.", "chosen": "Hi there!", "rejected": "No."},
               {"messages": [{"role": "user", "content": "2+2?"}, {"role": "assistant", "content": "4"},
                             {"role": "user", "content": "and 3+3?"}],
                "chosen": [{"role": "assistant", "content": "6"}], "rejected": [{"role": "assistant", "content": "7"}]}]
    (tmp_path / "p.jsonl").write_text("\n".join(json.dumps(r) for r in records) + "\n")
    pq.write_table(pa.Table.from_pylist(records[:1]), str(tmp_path / "p.parquet"))
    t, tok = ChatTemplate.load("chatml"), ByteTokenizer()
    a, b = Pairs([str(tmp_path / "p.jsonl")], t, tok), Pairs([str(tmp_path / "p.parquet")], t, tok)
    assert len(a) == 2 and len(b) == 1
    assert all((x[0] == y[0]).all() and (x[1] == y[1]).all() for x, y in zip(a.rows[:2], b.rows))
    for k, (ids, mask) in enumerate(a.rows):  # the targets: the final answer and its end, never the earlier "4"
        target = tok.decode(ids[mask > 0])
        assert target in ("Hi there!", "No.", "6<|im_end|>\n", "7<|im_end|>\n"), target
        if k < 2:  # a standard (text) pair: no template; the end-of-document id ends each side, a target
            assert tok.decode(ids) == "Say hi." + target and ids[-1] == tok.eos_id and mask[-1]
