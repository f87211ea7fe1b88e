"""training.objective = "grpo": each step's microbatches are rollouts the model itself just wrote.

`GRPOBatches` is the trainer's loader for GRPO. At the first microbatch of every num_iterations-th
step it makes a batch of rollouts, in named parts:

  prompts      the step's prompts (torchmeg.data.prompts: a function of (seed, step)), each repeated
               num_generations times: global rows 0..R-1, group g = rows gG..gG+G-1
  generate     this rank's rows (a contiguous share of the data-parallel group) by the serving engine
               on the live weights (torchmeg.train.rollout)
  score        the reward functions on this rank's rows (torchmeg.train.rewards); rewards, lengths and
               truncation gathered over the data-parallel group: the advantages are computed over the
               whole global batch (torchmeg.train.grpo_loss.advantages), every rank the same numbers
  rows         prompt + completion per row, right-padded to data.seq_len; targets: the completion
  old / ref    with num_iterations > 1 the log-probs before this batch's first update; with beta > 0
               the reference's (the run's starting weights, swapped in for one forward per row)

then hands out the same microbatches for num_iterations steps. Metrics as TRL names them: reward,
reward_std, rewards/<function>/mean and /std, frac_reward_zero_std, completions/mean_length,
/min_length, /max_length, /clipped_ratio; and the rollout's time and tokens per second, apart from
the training step's.
"""
from __future__ import annotations

import contextlib
import json
import os
from typing import Callable

import torch
import torch.distributed as dist

from torchmeg.checkpoint.manager import weights_from
from torchmeg.config.errors import ConfigError
from torchmeg.batching.generation import Sampling
from torchmeg.kernels.fused_ce import IGNORE
from torchmeg.models.lora import adapters_off
from torchmeg.parallel.data import reshard_all
from torchmeg.train import rollout
from torchmeg.train.grpo_loss import RolloutRows, advantages, nanstd, token_logps
from torchmeg.train.rewards import call_rewards, load_reward_funcs


def stop_tokens(tokenizer, template) -> tuple[frozenset, tuple[str, ...]]:
    """(end-of-sequence ids, stop strings): the tokenizer's end of text (and the ends a release's
    generation_config.json lists), and the chat template's end of turn (one token: an id; several: a
    stop string, its tokens kept in the completion)."""
    eos, stops = set(tokenizer.end_ids), ()
    end, end_id = template.end_of_turn(tokenizer) if template is not None else ("", None)
    if end_id is not None:
        eos.add(end_id)
    elif end:
        stops = (end,)
    return frozenset(i for i in eos if i is not None and i >= 0), stops


class GRPOBatches:
    def __init__(self, trainer, prompts, template):
        cfg, g = trainer.cfg, trainer.cfg.grpo
        self.t, self.cfg, self.g, self.prompts = trainer, cfg, g, prompts
        self.funcs, weights = load_reward_funcs(list(g.reward_funcs), list(g.reward_weights))
        self.weights = torch.tensor(weights, dtype=torch.float64)
        self.eos_ids, self.stops = stop_tokens(trainer.tokenizer, template)
        self.group = trainer.loss_group
        self.share, self.shares = dist.get_rank(self.group), dist.get_world_size(self.group)
        self.rows = trainer.layout.global_batch
        self.step = trainer.start_step
        self.micro: list = []
        self._served = 0
        self.window: list[dict] = []  # the rollouts' metrics since the last logged step
        self.log_path = os.path.join(cfg.run_dir, "completions.jsonl") if g.log_completions else None
        # how the reference's forward runs (beta > 0), the header's line on it, and the copy of the
        # reference's weights the run holds (none under LoRA or at beta 0: what `plan --measure` counts)
        self.as_reference, self.note, self.reference_held = reference_weights(trainer)

    def __iter__(self):
        return self

    def __next__(self):
        if not self.micro or self._served == self.t.layout.accum:
            self.step += 1
            self._served = 0
            if (self.step - 1) % self.g.num_iterations == 0 or not self.micro:
                self._rollout()
        batch = self.micro[self._served]
        self._served += 1
        return batch

    # ---- one batch of rollouts ------------------------------------------------------------------
    def _rollout(self) -> None:
        g, t = self.g, self.t
        k = (self.step - 1) // g.num_iterations  # this rollout's number: its prompts and its seed
        n_prompts = self.rows // g.num_generations
        step_prompts = [self.prompts.at(k * n_prompts + p) for p in range(n_prompts)]
        mine = rollout.share_rows(self.rows, self.shares, self.share)
        rows = [step_prompts[i // g.num_generations] for i in mine]  # each row's prompt
        sampling = Sampling(g.temperature, g.top_k, g.top_p, seed=(self.cfg.job.seed * 1_000_003 + k) % (1 << 62))
        with t.watchdog.inside(f"rollouts for step {self.step}"), rollout.gathered_weights(t.model):
            outs, timing = rollout.generate(t.model, t.tokenizer, t.device, [p.ids for p in rows], list(mine),
                                            sampling, g.max_completion_length, self.eos_ids, self.stops)
        texts = [self._cut(o.text) for o in outs]
        completions = [[{"role": "assistant", "content": x}] if isinstance(p.prompt, list) else x
                       for x, p in zip(texts, rows)]
        # every column of the prompt set, None where a record lacks it (a missing one shifted the others')
        columns = {key: [p.columns.get(key) for p in rows] for key in self.prompts.columns}
        rewards = call_rewards(self.funcs, [p.prompt for p in rows], completions, [o.completion for o in outs],
                               columns, self.step)
        local = torch.tensor([r + [len(o.completion), float(o.truncated)] for r, o in zip(rewards, outs)],
                             dtype=torch.float64)
        every = self._gather(local)  # [R, funcs + 2]
        adv, summed, zero_std = advantages(every[:, :-2], self.weights, g.num_generations, g.scale_rewards)
        self.micro = self._microbatches(rows, outs, adv[mine.start:mine.stop])
        lengths, truncated = every[:, -2], every[:, -1].bool()
        kept = torch.where(truncated, 0.0, lengths) if g.mask_truncated_completions else lengths
        t.step_fn.loss_fn.token_scale = self.shares * t.layout.accum / max(float(kept.sum()), 1.0)
        extra_logps(t.step_fn, self.micro, g, self.as_reference)  # (old policy's, reference's)
        for m in t.moe_layers:  # routing during the rollouts and the extra forwards is not training load
            m.tokens_per_expert.zero_()
        self.window.append(self._metrics(every, summed, zero_std, lengths, truncated, timing))
        if self.log_path is not None:
            self._log(step_prompts, outs, every, adv)

    def _cut(self, text: str) -> str:
        for s in self.stops:
            if s in text:
                text = text[:text.index(s)]
        return text

    def _gather(self, local: torch.Tensor) -> torch.Tensor:
        parts = [torch.empty_like(local) for _ in range(self.shares)]
        dist.all_gather(parts, local.to(self.t.device) if self.t.device.type == "cuda" else local, group=self.group)
        return torch.cat([p.cpu() for p in parts])

    def _microbatches(self, rows, outs, adv) -> list:
        g, seq, L = self.g, self.cfg.data.seq_len, self.t.layout.local_batch
        filler = max(self.t.tokenizer.eos_id, 0)
        inputs = torch.full((len(outs), seq), filler, dtype=torch.long)
        labels = torch.full((len(outs), seq), IGNORE, dtype=torch.long)
        sampling = torch.zeros(len(outs), seq, dtype=torch.float32)
        for r, (p, o) in enumerate(zip(rows, outs)):
            prompt = p.ids
            row = prompt + o.completion
            inputs[r, :min(len(row), seq)] = torch.tensor(row[:seq])
            if g.mask_truncated_completions and o.truncated:
                continue
            at = len(prompt) - 1  # position predicting the completion's first token
            labels[r, at:at + len(o.completion)] = torch.tensor(o.completion)
            sampling[r, at:at + len(o.completion)] = torch.tensor(o.logps, dtype=torch.float32)
        out = []
        for m in range(self.t.layout.accum):
            s = slice(m * L, (m + 1) * L)
            out.append((inputs[s], labels[s], RolloutRows(adv[s].float().to(self.t.device),
                                                          sampling[s].to(self.t.device))))
        return out

    def window_metrics(self) -> dict:
        """The rollouts' metrics over the steps since the last logged one (TRL logs its means over the
        logging interval too): means, the lengths' min and max over the window; then a new window."""
        w, self.window = self.window, []
        if not w:
            return {}
        out = {k: sum(m[k] for m in w) / len(w) for k in w[0]}
        out["completions/min_length"] = min(m["completions/min_length"] for m in w)
        out["completions/max_length"] = max(m["completions/max_length"] for m in w)
        out["rollout_tokens_per_sec"] = sum(m["rollout_tokens"] for m in w) / max(sum(m["rollout_s"] for m in w), 1e-9)
        return out

    def _metrics(self, every, rewards, zero_std, lengths, truncated, timing) -> dict:
        on = self.t.device if self.t.device.type == "cuda" else "cpu"  # (NCCL reduces device tensors)
        secs = torch.tensor([timing["seconds"]], dtype=torch.float64, device=on)
        dist.all_reduce(secs, op=dist.ReduceOp.MAX, group=self.group)
        prompts = torch.tensor([timing["prompt_tokens"], timing["cached_prompt_tokens"]], dtype=torch.float64, device=on)
        dist.all_reduce(prompts, group=self.group)  # every rank's rows
        m = {"reward": torch.nanmean(rewards).item(), "reward_std": nanstd(rewards).item(),
             "frac_reward_zero_std": zero_std.double().mean().item(),
             "completions/mean_length": lengths.mean().item(), "completions/min_length": lengths.min().item(),
             "completions/max_length": lengths.max().item(), "completions/clipped_ratio": truncated.double().mean().item(),
             "rollout_s": secs.item(), "rollout_tokens": lengths.sum().item(),
             "rollout_tokens_per_sec": lengths.sum().item() / max(secs.item(), 1e-9),
             # prompt tokens of the step's rollouts: computed, and copied from a group's first (prefix caching)
             "rollout_prompt_tokens": prompts[0].item() - prompts[1].item(), "rollout_cached_prompt_tokens": prompts[1].item()}
        for j, (name, _) in enumerate(self.funcs):
            m[f"rewards/{name}/mean"] = torch.nanmean(every[:, j]).item()
            m[f"rewards/{name}/std"] = nanstd(every[:, j]).item()
        return m

    def _log(self, step_prompts, outs, every, adv) -> None:
        """Rank 0 appends every rollout of the step (all ranks' completions gathered as token ids)."""
        width = self.g.max_completion_length + 1
        local = torch.full((len(outs), width), -1, dtype=torch.long)
        for r, o in enumerate(outs):
            local[r, :len(o.completion)] = torch.tensor(o.completion)
        ids = self._gather(local)
        if dist.get_rank() != 0:
            return
        os.makedirs(os.path.dirname(self.log_path), exist_ok=True)
        with open(self.log_path, "a", encoding="utf-8") as fh:
            for i in range(self.rows):
                p = step_prompts[i // self.g.num_generations]
                tokens = [int(x) for x in ids[i] if x >= 0]
                text = self._cut(self.t.tokenizer.decode([x for x in tokens if x not in self.eos_ids]))
                fh.write(json.dumps({"step": self.step, "row": i, "prompt": p.prompt, "completion": text,
                                     "completion_ids": tokens, "advantage": round(adv[i].item(), 6),
                                     "rewards": {n: every[i, j].item() for j, (n, _) in enumerate(self.funcs)}}) + "\n")


@torch.no_grad()
def extra_logps(ms, micro: list, g, as_reference) -> None:
    """The old policy's log-probs (num_iterations > 1) and the reference's (beta > 0) of each
    microbatch's rows, before the step (also what the planner traces: torchmeg.plan.post_training)."""
    if g.num_iterations > 1:
        for b in micro:
            b[2].old = policy_logps(ms, b, g.temperature)
    if g.beta != 0.0:
        with as_reference():
            for b in micro:
                b[2].ref = policy_logps(ms, b, g.temperature)


def policy_logps(ms, batch, temperature: float) -> torch.Tensor:
    """Each label's log-probability under the model as it is now, in eval mode (no dropout)."""
    was = ms.model.training
    ms.model.eval()
    logits = ms.model(ms.local(batch[0]))
    ms.model.train(was)
    return token_logps(logits, ms.local(batch[1]), temperature)


class swapped:
    """The reference's values in the model's parameters for the block (copied in place: FSDP keeps
    its own references to the sharded storage), the trained values back after. FSDP's unsharded copies
    are freed on both sides: the root module keeps its own after a forward, which would otherwise carry
    one set of values into the other's forward."""

    def __init__(self, model, reference):
        self.model, self.params, self.reference, self.saved = model, [], reference, None

    def __enter__(self):
        reshard_all(self.model)
        # (listed after the reshard: while FSDP holds a module unsharded, its parameters are the
        # unsharded tensors, whose storage the reshard frees)
        self.params = list(self.model.parameters())
        self.saved = [p.detach().clone() for p in self.params]
        for p, r in zip(self.params, self.reference):
            p.detach().copy_(r)

    def __exit__(self, *exc):
        reshard_all(self.model)
        for p, s in zip(self.params, self.saved):
            p.detach().copy_(s)
        self.saved = None


def reference_weights(trainer) -> tuple[Callable[[], contextlib.AbstractContextManager] | None, str, list]:
    """grpo.beta > 0: how the reference's forward runs -> (a factory of the block in which the model is
    the reference, or None; the header's note; the tensors held for it). Under LoRA the base model, the adapters switched off (as
    TRL with PEFT; they start at B = 0, so it is also the model the run started from): no copy.
    Otherwise a copy of the reference's parameters (each rank its shards) swapped in: the weights the
    run starts from, taken at step 0 or read back from checkpoint.initial_load_path on a resume."""
    cfg, model = trainer.cfg, trainer.model
    if cfg.grpo.beta == 0.0:
        return None, "no reference model (grpo.beta = 0)", []
    if cfg.lora.enable:  # the frozen base is the reference: TRL under PEFT, and what the run started from (B = 0)
        return (lambda: adapters_off(model)), "reference: the base model, the adapters switched off (no copy of any weight)", []
    params = list(model.parameters())
    if trainer.state.step == 0:
        copy = [p.detach().clone() for p in params]
        return ((lambda: swapped(model, copy)),
                f"reference: the starting weights (a copy of {sum(p.numel() for p in params) / 1e6:.2f}M parameters)", copy)
    where = cfg.checkpoint.initial_load_path
    if not where:
        raise ConfigError(f"grpo.beta = {cfg.grpo.beta}: resuming at step {trainer.state.step} needs the reference (the "
                          f"weights the run started from), which only checkpoint.initial_load_path can give back; "
                          f"set it to the checkpoint the run started from, or start the run anew")
    with weights_from(model, where, "checkpoint.initial_load_path") as source:
        reference = [p.detach().clone() for p in model.parameters()]
    return (lambda: swapped(model, reference)), f"reference: {source} (checkpoint.initial_load_path)", reference
