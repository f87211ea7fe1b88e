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

TRL's other keys and loss types, as it writes them: importance_sampling_level = "sequence" (GSPO: the
ratio is exp of each completion's mean log-ratio, one per row); delta (two-sided clipping: the unclipped
ratio capped at delta); cispo (-min(ratio, epsilon_high), no gradient, x A_i x logp; the dapo
normalization); sapo (a sigmoid gate 4/tau x sigmoid(tau (ratio - 1)) in place of the clip, tau by the
advantage's sign; grpo's normalization); luspo (each completion's token sum, averaged over rows);
vespo (a no-gradient Gamma weight of the sequence ratio x A_i x logp; dapo's normalization).

The importance-sampling ratio compares the trainer's log-probs with the engine's (`sampling`):
exp(old - sampling) per token (or summed per sequence), truncated at the cap or masked beyond it.
"""
from __future__ import annotations

import math
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


TOKEN_SUM = ("dapo", "cispo", "vespo")  # normalized by the global batch's completion tokens (token_scale)


def gamma_weights(adv, log_ratio, mask, is_ratio, k_pos: float, lambda_pos: float, k_neg: float,
                  lambda_neg: float) -> torch.Tensor:
    """VESPO's [B, 1] weights (TRL's get_gamma_weights): phi(w) = e^lambda w^k e^(-lambda w) of the
    sequence's importance ratio w (its log-ratio summed, times the engine's token ratio), k and lambda
    by the advantage's sign; no gradient (it scales -A x logp)."""
    with torch.no_grad():
        low = math.log(1e-8)
        seq = (log_ratio.clamp(-20.0, 20.0) * mask).sum(-1, keepdim=True)
        if is_ratio is not None:
            seq = seq + is_ratio.log().clamp(low, 20.0).sum(-1, keepdim=True)
        log_w = seq.clamp(low, 20.0)
        nonneg = adv >= 0
        k = torch.where(nonneg, k_pos, k_neg).to(log_w.dtype)
        lam = torch.where(nonneg, lambda_pos, lambda_neg).to(log_w.dtype).clamp(min=1e-4)
        return torch.exp(lam + k * log_w - lam * log_w.exp()).nan_to_num(nan=0.0, posinf=0.0, neginf=0.0)


class GRPOLoss:
    """`see(batch)` gives it the microbatch's RolloutRows; `token_scale` (dapo, cispo, vespo) is set per
    step. level: TRL's importance_sampling_level (token, or sequence: GSPO, the mean log-ratio of each
    completion); delta: two-sided clipping (the ratio capped at delta, INTELLECT-2; 0 = off); sapo:
    (temperature for positive advantages, for the others); vespo: (k_pos, lambda_pos, k_neg, lambda_neg)."""

    def __init__(self, loss_type: str, beta: float, epsilon: float, epsilon_high: float, temperature: float,
                 max_completion_length: int, importance_sampling: str = "none", cap: float = 3.0,
                 bias_correction_kl: bool = True, level: str = "token", delta: float = 0.0,
                 sapo: tuple = (1.0, 1.05), vespo: tuple = (2.0, 3.0, 3.0, 2.0)):
        self.loss_type, self.beta, self.temperature = loss_type, beta, temperature
        self.bias_correction_kl, self.level, self.delta, self.sapo, self.vespo = \
            bias_correction_kl, level, delta, tuple(sapo), tuple(vespo)
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
        log_ratio = logp - old
        if self.level == "sequence":  # GSPO: one ratio per completion, its tokens' mean log-ratio
            log_ratio = ((log_ratio * mask).sum(-1) / mask.sum(-1).clamp(min=1.0))[:, None]
        coef_1 = torch.exp(log_ratio)
        adv = r.advantages[:, None].to(logp.dtype)
        is_ratio = None
        if self.importance_sampling != "none":
            is_ratio = importance_ratio(old, r.sampling, mask, self.importance_sampling, self.cap)
        kl = None
        if self.beta != 0.0:
            d = r.ref - logp
            kl = torch.exp(d) - d - 1
            if self.bias_correction_kl:
                kl = kl * coef_1
        kind = self.loss_type
        if kind == "cispo":  # the clipped ratio (no gradient) weights the log-prob's
            per_token = -coef_1.clamp(max=self.eps_high).detach() * adv * logp
        elif kind == "sapo":  # a soft gate in place of the clip
            t = torch.where(adv > 0, self.sapo[0], self.sapo[1]).to(coef_1.dtype)
            per_token = -torch.sigmoid(t * (coef_1 - 1)) * 4 / t * adv
        elif kind == "vespo":
            per_token = -gamma_weights(adv, logp - old, mask, is_ratio, *self.vespo) * adv * logp
        else:
            coef_2 = coef_1.clamp(1 - self.eps_low, 1 + self.eps_high)
            if self.delta > 0:
                coef_1 = coef_1.clamp(max=self.delta)
            per_token = -torch.min(coef_1 * adv, coef_2 * adv)
        if is_ratio is not None and kind != "vespo":  # (vespo folds it into its weights)
            per_token = per_token * is_ratio
        if kl is not None:
            per_token = per_token + self.beta * kl
        masked = per_token * mask
        if kind in ("grpo", "sapo"):
            loss = (masked.sum(-1) / mask.sum(-1).clamp(min=1.0)).mean()
        elif kind == "luspo":  # each completion's sum: a sequence's loss scaled by its length
            loss = masked.sum(-1).mean()
        elif kind == "bnpo":
            loss = masked.sum() / mask.sum().clamp(min=1.0)
        elif kind == "dr_grpo":
            loss = masked.sum() / (labels.shape[0] * self.max_completion_length)
        elif kind in TOKEN_SUM:
            if self.token_scale is None:
                raise RuntimeError("GRPOLoss: the step's completion-token count sets token_scale before the first loss")
            loss = masked.sum() * self.token_scale
        else:
            raise ValueError(f"unknown GRPO loss type {kind!r}")
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
        if self.loss_type == "cispo":  # (TRL: the share whose ratio the cap cut, positive advantages)
            low, high = torch.zeros_like(coef_1), ((coef_1 > self.eps_high) & (adv > 0)).to(coef_1.dtype)
        else:
            low = ((coef_1 < 1 - self.eps_low) & (adv < 0)).to(coef_1.dtype)
            high = ((coef_1 > 1 + self.eps_high) & (adv > 0)).to(coef_1.dtype)
        # Clip shares per token, or per completion where the ratio is one per completion (TRL's
        # global_masked_mean): the count they are divided by is then the rows'.
        per_row = coef_1.shape[-1] == 1
        clip_w = torch.ones_like(coef_1) if per_row else mask
        gap = (old - self.rows.sampling).abs() * mask
        ratio = is_ratio.expand_as(mask) if is_ratio is not None else torch.ones_like(mask)
        s = torch.stack([mask.sum(), (low * clip_w).sum(), (high * clip_w).sum(),
                         (torch.maximum(low, high) * clip_w).sum(),
                         (kl * mask).sum() if kl is not None else mask.new_zeros(()), (entropy * mask).sum(),
                         gap.sum(), (ratio * mask).sum(), clip_w.sum()]).double()
        self.sums = s if self.sums is None else self.sums + s
        g = gap.max().double().reshape(1)
        self.gap_max = g if self.gap_max is None else torch.maximum(self.gap_max, g)

    def discard_step(self) -> None:
        """Forget the sums of the microbatches seen so far (compile.verify_cache's eager pass)."""
        self.sums = self.gap_max = None

    def step_metrics(self, group) -> dict:
        """The step's metrics over every token of the global batch (two small all-reduces)."""
        if self.sums is None:
            return {}
        s, g, self.sums, self.gap_max = self.sums, self.gap_max, None, None
        if dist.is_initialized():  # (else one process: its sums are the batch's)
            dist.all_reduce(s, group=group)
            dist.all_reduce(g, op=dist.ReduceOp.MAX, group=group)
        n, c = max(s[0].item(), 1.0), max(s[8].item(), 1.0)
        # The clip shares TRL logs for each loss type (sapo and vespo clip nothing: none).
        if self.loss_type == "cispo":
            clips = {"cispo_clip_ratio": s[2].item() / c}
        elif self.loss_type in ("sapo", "vespo"):
            clips = {}
        else:
            clips = {"clip_ratio/low_mean": s[1].item() / c, "clip_ratio/high_mean": s[2].item() / c,
                     "clip_ratio/region_mean": s[3].item() / c}
        out = {**clips, "entropy": s[5].item() / n,
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
