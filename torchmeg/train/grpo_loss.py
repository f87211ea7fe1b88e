"""GRPO's objective over one microbatch of rollouts, as TRL 1.16's `GRPOTrainer._compute_loss` writes it.

A row is prompt + completion, right-padded; its targets (labels) are the completion's tokens (IGNORE
elsewhere). Per target token t of row i, with logp the model's log-probability of the token at the
rollouts' temperature, old the same before this batch's first update, A_i the row's advantage:

    ratio  = exp(logp - old)                      (old = logp.detach() on a batch's first pass)
    loss_t = -min(ratio x A_i, clip(ratio, 1 - epsilon, 1 + epsilon_high) x A_i)
             x is_ratio_t                           (truncated importance sampling, optional)
             + beta x (exp(ref - logp) - (ref - logp) - 1)   (KL to the reference, beta > 0)
               x ratio                              (use_bias_correction_kl, TRL's default: the unbiased
                                                     reverse-KL gradient, DeepSeek-V3.2; differentiable,
                                                     so it moves the gradient even where ratio = 1)

and the token normalization of `loss_type` over the GLOBAL batch, so that every layout and
accumulation gives one number: grpo: each row's token mean, averaged over the batch's rows; dr_grpo:
the sum over rows x max_completion_length; dapo: the sum over the global batch's completion tokens
(`token_scale`, set each step from the count the rollouts gathered); bnpo: each microbatch's token
mean (TRL's: by definition a microbatch-size quantity).

The importance-sampling ratio compares the trainer's log-probs with the engine's (`sampling`):
exp(old - sampling) per token (or summed per sequence), truncated at the cap or masked beyond it.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F

from torchmeg.kernels.fused_ce import IGNORE


@dataclass
class RolloutRows:
    """One microbatch's per-row data beside its tokens (the batch's third entry)."""
    advantages: torch.Tensor            # [B]
    sampling: torch.Tensor              # [B, S] the engine's log-probs at the target positions (0 elsewhere)
    old: torch.Tensor | None = None     # [B, S] before this batch's first update (num_iterations > 1)
    ref: torch.Tensor | None = None     # [B, S] the reference's (beta > 0)


def token_logps(logits: torch.Tensor, labels: torch.Tensor, temperature: float) -> torch.Tensor:
    """[B, S] log p(label) of logits / temperature (0 where the label is IGNORE), in fp32 at least."""
    x = logits if logits.dtype == torch.float64 else logits.float()
    if temperature > 0:
        x = x / temperature
    tok = F.cross_entropy(x.flatten(0, 1), labels.flatten(0, 1), reduction="none", ignore_index=IGNORE)
    return -tok.view(labels.shape)


def importance_ratio(old: torch.Tensor, sampling: torch.Tensor, mask: torch.Tensor, mode: str, cap: float):
    """TRL's vLLM importance-sampling correction: [B, S] (token modes) or [B, 1] (sequence modes)."""
    diff = torch.nan_to_num((old - sampling) * mask, nan=0.0)
    ratio = torch.exp(diff.sum(-1, keepdim=True) if mode.startswith("sequence") else diff)
    if mode.endswith("truncate"):
        return ratio.clamp(max=cap)
    return ratio.masked_fill(ratio > cap, 0.0)


class GRPOLoss:
    """`see(batch)` gives it the microbatch's RolloutRows; `token_scale` (dapo) is set per step."""

    def __init__(self, loss_type: str, beta: float, epsilon: float, epsilon_high: float, temperature: float,
                 max_completion_length: int, importance_sampling: str = "none", cap: float = 3.0,
                 bias_correction_kl: bool = True):
        self.loss_type, self.beta, self.temperature = loss_type, beta, temperature
        self.bias_correction_kl = bias_correction_kl
        self.eps_low, self.eps_high = epsilon, epsilon if epsilon_high < 0 else epsilon_high
        self.max_completion_length, self.importance_sampling, self.cap = max_completion_length, importance_sampling, cap
        self.rows: RolloutRows | None = None
        self.token_scale = None
        self.counts_chosen = False  # (build.count_targets: not a DPO loss with an sft term)
        self.sums = self.gap_max = None
        self.record = True

    def see(self, batch) -> None:
        self.rows = batch[2]

    def __call__(self, logits, labels):
        r = self.rows
        mask = (labels != IGNORE).float()
        logp = token_logps(logits, labels, self.temperature)
        old = r.old if r.old is not None else logp.detach()
        coef_1 = torch.exp(logp - old)
        coef_2 = coef_1.clamp(1 - self.eps_low, 1 + self.eps_high)
        adv = r.advantages[:, None].to(logp.dtype)
        per_token = -torch.min(coef_1 * adv, coef_2 * adv)
        is_ratio = None
        if self.importance_sampling != "none":
            is_ratio = importance_ratio(old, r.sampling, mask, self.importance_sampling, self.cap)
            per_token = per_token * is_ratio
        kl = None
        if self.beta != 0.0:
            d = r.ref - logp
            kl = torch.exp(d) - d - 1
            if self.bias_correction_kl:
                kl = kl * coef_1
            per_token = per_token + self.beta * kl
        masked = per_token * mask
        if self.loss_type == "grpo":
            loss = (masked.sum(-1) / mask.sum(-1).clamp(min=1.0)).mean()
        elif self.loss_type == "bnpo":
            loss = masked.sum() / mask.sum().clamp(min=1.0)
        elif self.loss_type == "dr_grpo":
            loss = masked.sum() / (labels.shape[0] * self.max_completion_length)
        elif self.loss_type == "dapo":
            if self.token_scale is None:
                raise RuntimeError("GRPOLoss: the step's completion-token count sets token_scale before the first loss")
            loss = masked.sum() * self.token_scale
        else:
            raise ValueError(f"unknown GRPO loss type {self.loss_type!r}")
        if self.record and torch.is_grad_enabled():
            self._record(logits, logp.detach(), old, mask, coef_1.detach(), adv, kl, is_ratio)
        return loss

    @torch.no_grad()
    def _record(self, logits, logp, old, mask, coef_1, adv, kl, is_ratio) -> None:
        """The step's sums (TRL's metrics): tokens, clipped low / high / region, KL, entropy, the
        engine-vs-trainer log-prob gap (|old - sampling|) and its max, the importance ratio."""
        x = logits.detach()
        x = x if x.dtype == torch.float64 else x.float()
        if self.temperature > 0:
            x = x / self.temperature
        lp = x.log_softmax(-1)
        entropy = -(lp.exp() * lp).sum(-1)
        low = ((coef_1 < 1 - self.eps_low) & (adv < 0)).float()
        high = ((coef_1 > 1 + self.eps_high) & (adv > 0)).float()
        gap = (old - self.rows.sampling).abs() * mask
        ratio = is_ratio.expand_as(mask) if is_ratio is not None else torch.ones_like(mask)
        s = torch.stack([mask.sum(), (low * mask).sum(), (high * mask).sum(), (torch.maximum(low, high) * mask).sum(),
                         (kl * mask).sum() if kl is not None else mask.new_zeros(()), (entropy * mask).sum(),
                         gap.sum(), (ratio * mask).sum()]).double()
        self.sums = s if self.sums is None else self.sums + s
        g = gap.max().double().reshape(1)
        self.gap_max = g if self.gap_max is None else torch.maximum(self.gap_max, g)

    def step_metrics(self, group) -> dict:
        """The step's metrics over every token of the global batch (two small all-reduces)."""
        if self.sums is None:
            return {}
        s, g, self.sums, self.gap_max = self.sums, self.gap_max, None, None
        dist.all_reduce(s, group=group)
        dist.all_reduce(g, op=dist.ReduceOp.MAX, group=group)
        n = max(s[0].item(), 1.0)
        out = {"clip_ratio/low_mean": s[1].item() / n, "clip_ratio/high_mean": s[2].item() / n,
               "clip_ratio/region_mean": s[3].item() / n, "entropy": s[5].item() / n,
               "sampling/sampling_logp_difference/mean": s[6].item() / n,
               "sampling/sampling_logp_difference/max": g.item()}
        if self.beta != 0.0:
            out["kl"] = s[4].item() / n
        if self.importance_sampling != "none":
            out["sampling/importance_sampling_ratio/mean"] = s[7].item() / n
        return out


def nanstd(x: torch.Tensor, dim=None) -> torch.Tensor:
    """Standard deviation ignoring NaNs, Bessel-corrected (NaN for fewer than two values): TRL's."""
    mean = torch.nanmean(x, dim=dim, keepdim=True)
    var = torch.nanmean((x - mean) ** 2, dim=dim, keepdim=True)
    count = (~torch.isnan(x)).sum(dim=dim, keepdim=True)
    var = var * torch.where(count > 1, count / (count - 1), torch.full_like(var, float("nan")))
    std = var.sqrt()
    return std.squeeze(dim) if dim is not None else std.reshape(())


def advantages(rewards_per_func: torch.Tensor, weights: torch.Tensor, group: int, scale: str):
    """TRL's (sum_then_normalize): the weighted sum of each completion's rewards (NaN where every
    function returned None), minus its group's mean, divided by the group's (or the batch's) std +
    1e-4 unless scale = "none" -> (advantages [R], rewards [R], the rows whose group's std is 0)."""
    unscorable = torch.isnan(rewards_per_func).all(dim=1)
    rewards = (rewards_per_func * weights[None]).nansum(dim=1)
    rewards[unscorable] = float("nan")
    grouped = rewards.view(-1, group)
    mean = torch.nanmean(grouped, dim=1).repeat_interleave(group)
    if scale == "batch":
        std = nanstd(rewards).expand_as(rewards)
    else:
        std = nanstd(grouped, dim=1).repeat_interleave(group)
    adv = rewards - mean
    if scale != "none":
        adv = adv / (std + 1e-4)
    return torch.nan_to_num(adv, nan=0.0), rewards, torch.isclose(std, torch.zeros_like(std))
