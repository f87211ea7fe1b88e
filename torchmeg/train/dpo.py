"""Direct preference optimisation: the loss over (chosen, rejected) pairs against a frozen reference.

The reference is the model the run starts from (step 0: a fresh init, checkpoint.initial_load_path, a
converted checkpoint). Its sequence log-probs are computed once, in a first pass over every pair, with
the run's own layout (each data-parallel rank a share, then summed), and saved beside the run's
checkpoints (`dpo_reference.pt`): a resumed run reads them back instead of recomputing them from weights
that have trained since. Precomputing (TRL's `precompute_ref_log_probs`) costs one forward per pair once
and no memory during training; a second, frozen, sharded model would cost a forward per step and the
weights twice.

The reference is the model the run starts from, or the checkpoint `dpo.reference_path` names (TRL's
`ref_model`): its weights are loaded into the model for the first pass, and the starting weights put
back after it.

Loss (TRL 1.16's `loss_type`, formulas as `DPOTrainer._compute_loss` writes them; `pair_loss` below),
with x_c = pc - rc and x_r = pr - rr a row's log-ratio to the reference and d = x_c - x_r: sigmoid,
hinge, ipo (per-token ratios), robust and exo_pair (dpo.label_smoothing), apo_zero, apo_down,
bco_pair, nca_pair, sppo_hard, sigmoid_norm; and "sft", the chosen rows' negative log-likelihood per
target token of the global batch (RPO: "sigmoid,sft"). Several types joined by "," are summed with
dpo.loss_weights. The pair terms are means over the global batch's pairs (every rank holds as many).
Metrics: rewards beta x (p - r) of chosen and rejected, their margin, and the share of pairs whose
chosen reward is the higher (accuracy).
"""
from __future__ import annotations

import os

import torch
import torch.distributed as dist
import torch.nn.functional as F

from torchmeg.checkpoint.manager import weights_from
from torchmeg.config.errors import ConfigError
from torchmeg.kernels.fused_ce import IGNORE

REFERENCE_FILE = "dpo_reference.pt"


def sequence_logps(logits, labels: torch.Tensor) -> torch.Tensor:
    """[rows] sum over each row's targets of log p(target): per-token cross-entropy (vocab-sharded
    logits under loss parallel give a DTensor, gathered here: a number per token)."""
    x = logits.flatten(0, 1)
    x = x if x.dtype == torch.float64 else x.float()  # at least fp32: a row's sum spans hundreds of tokens
    tok = F.cross_entropy(x, labels.flatten(0, 1), reduction="none")
    if hasattr(tok, "full_tensor"):
        tok = tok.full_tensor()
    return -tok.view(labels.shape).sum(-1)


PAIR_LOSSES = ("sigmoid", "hinge", "ipo", "robust", "exo_pair", "apo_zero", "apo_down", "bco_pair", "nca_pair",
               "sppo_hard", "sigmoid_norm")
LOSS_TYPES = PAIR_LOSSES + ("sft",)


def pair_loss(kind: str, chosen, rejected, beta: float, smoothing: float = 0.0, n_chosen=None, n_rejected=None):
    """[pairs] the loss of each pair, `chosen` / `rejected` the rows' log-ratios to the reference (summed
    over their targets), n_* their target counts (ipo, sigmoid_norm): TRL's formula for `kind`."""
    d = chosen - rejected
    if kind == "sigmoid":
        return -F.logsigmoid(beta * d)
    if kind == "hinge":
        return torch.relu(1 - beta * d)
    if kind in ("ipo", "sigmoid_norm"):
        avg = chosen / n_chosen.clamp(min=1.0) - rejected / n_rejected.clamp(min=1.0)
        return (avg - 1 / (2 * beta)) ** 2 if kind == "ipo" else -F.logsigmoid(beta * avg)
    if kind == "robust":
        return (-(1 - smoothing) * F.logsigmoid(beta * d) + smoothing * F.logsigmoid(-beta * d)) / (1 - 2 * smoothing)
    if kind == "exo_pair":
        eps = torch.tensor(smoothing, dtype=d.dtype, device=d.device)
        return (torch.sigmoid(beta * d) * (F.logsigmoid(beta * d) - torch.log1p(-eps))
                + torch.sigmoid(-beta * d) * (F.logsigmoid(-beta * d) - torch.log(eps)))
    if kind == "apo_zero":
        return 1 - torch.sigmoid(beta * chosen) + torch.sigmoid(beta * rejected)
    if kind == "apo_down":
        return torch.sigmoid(beta * chosen) + 1 - torch.sigmoid(beta * d)
    if kind == "bco_pair":
        return -F.logsigmoid(beta * chosen) - F.logsigmoid(-beta * rejected)
    if kind == "nca_pair":
        return -F.logsigmoid(beta * chosen) - 0.5 * F.logsigmoid(-beta * chosen) - 0.5 * F.logsigmoid(-beta * rejected)
    if kind == "sppo_hard":
        return (chosen - 0.5 / beta) ** 2 + (rejected + 0.5 / beta) ** 2
    raise ValueError(f"unknown DPO loss type {kind!r}")


def loss_terms(cfg) -> list[tuple[str, float]]:
    """(type, weight) of training.dpo_loss_type ("," joins several) with dpo.loss_weights (one each)."""
    kinds = [k.strip() for k in cfg.training.dpo_loss_type.split(",")]
    weights = list(cfg.dpo.loss_weights) or [1.0] * len(kinds)
    if len(weights) != len(kinds):
        raise ConfigError(f"dpo.loss_weights = {cfg.dpo.loss_weights}: one weight per training.dpo_loss_type term "
                          f"({cfg.training.dpo_loss_type!r}), or [] for all 1")
    return list(zip(kinds, (float(w) for w in weights)))


class DPOLoss:
    """The loss of one microbatch of pairs (rows chosen, rejected, chosen, ...); `see(batch)` gives it
    the microbatch's pair numbers, `table` [pairs, 2] the reference log-probs; `sft_scale` (set per step
    by count_targets when an "sft" term is in) = ranks x loss calls / chosen targets of the global batch."""

    def __init__(self, beta: float, terms: list[tuple[str, float]], smoothing: float = 0.0):
        self.beta, self.terms, self.smoothing = beta, terms, smoothing
        self.table, self.pair_ids, self.record = None, None, True
        self.sums, self.sft_scale = None, None
        self.counts_chosen = any(k == "sft" for k, _ in terms)

    def see(self, batch) -> None:
        self.pair_ids = batch[2]

    def __call__(self, logits, labels):
        if self.table is None:
            raise RuntimeError("DPOLoss: the reference log-probs are computed before the first step")
        logp = sequence_logps(logits, labels)
        ref = self.table[self.pair_ids.to(self.table.device)].to(logp.device)
        chosen, rejected = logp[0::2] - ref[:, 0], logp[1::2] - ref[:, 1]
        n = (labels != IGNORE).sum(-1).to(logp.dtype)
        loss = 0.0
        for kind, weight in self.terms:
            if kind == "sft":  # -(chosen rows' summed log-probs) / the global batch's chosen targets
                term = -logp[0::2].sum() * (self.sft_scale if torch.is_grad_enabled() else 1.0 / n[0::2].sum().clamp(min=1))
            else:
                term = pair_loss(kind, chosen, rejected, self.beta, self.smoothing, n[0::2], n[1::2]).mean()
            loss = loss + weight * term
        if self.record and torch.is_grad_enabled():  # training microbatches feed the step's reward metrics
            rc, rr = self.beta * chosen.detach(), self.beta * rejected.detach()
            s = torch.stack([rc.sum(), rr.sum(), (rc > rr).float().sum(), torch.tensor(float(len(rc)), device=rc.device)])
            self.sums = s if self.sums is None else self.sums + s
        return loss

    def discard_step(self) -> None:
        """Forget the sums of the microbatches seen so far (compile.verify_cache's eager pass)."""
        self.sums = None

    def step_metrics(self, group) -> dict:
        """The step's rewards over every pair of the global batch (one all-reduce of four numbers)."""
        if self.sums is None:
            return {}
        s, self.sums = self.sums.float(), None
        dist.all_reduce(s, group=group)
        n = max(s[3].item(), 1.0)
        rc, rr, acc = s[0].item() / n, s[1].item() / n, s[2].item() / n
        return {"dpo_rewards_chosen": rc, "dpo_rewards_rejected": rr, "dpo_margin": rc - rr, "dpo_accuracy": acc}


@torch.no_grad()
def reference_logps(ms, dataset, n_pairs: int, local_batch: int, dp: int, dp_rank: int, group, device) -> torch.Tensor:
    """[n_pairs, 2] the model's sequence log-probs of every pair's chosen and rejected rows. Rank r
    of dp takes pairs r, r + dp, ...; every rank runs as many forwards (FSDP gathers across dp), the
    last ones padded with repeats; the shares are summed over `group`."""
    table = torch.zeros(n_pairs, 2, dtype=torch.float64, device=device)
    mine = list(range(dp_rank, n_pairs, dp))
    per_rank = -(-n_pairs // dp)
    rounds = -(-per_rank // local_batch)
    was_training = ms.model.training
    ms.model.eval()
    for b in range(rounds):
        ids = mine[b * local_batch:(b + 1) * local_batch]
        real = len(ids)
        ids = (ids + [ids[-1] if ids else 0] * local_batch)[:local_batch]
        rows = [dataset.sample_of_pair(k) for k in ids]
        inputs = torch.cat([r[0] for r in rows])
        labels = torch.cat([r[1] for r in rows])
        with ms.loss_context():
            logp = sequence_logps(ms.model(ms.local(inputs)), ms.local(labels)).double()
        for j in range(real):
            table[ids[j], 0], table[ids[j], 1] = logp[2 * j], logp[2 * j + 1]
    ms.model.train(was_training)
    dist.all_reduce(table, group=group)
    return table


def prepare_reference(trainer) -> str:
    """The reference log-probs for `trainer`'s DPO loss: computed at step 0 (and saved), read back on a
    resume. -> the header note."""
    loss, cfg, state = trainer.step_fn.pairs, trainer.cfg, trainer.state
    pairs, reference = trainer.train_set.pairs, cfg.dpo.reference_path
    folder = trainer.ckpt.folder if trainer.ckpt is not None else cfg.run_dir
    path = os.path.join(folder, REFERENCE_FILE)
    if state.step > 0:
        if not os.path.isfile(path):
            raise ConfigError(f"training.objective = \"dpo\": resuming at step {state.step} needs the reference "
                              f"log-probs ({path}), which are gone; start the run anew")
        saved = torch.load(path, map_location="cpu", weights_only=True)
        if saved.get("fingerprint") != pairs.fingerprint:
            raise ConfigError(f"{path}: computed for other pairs (data.dataset or the template changed since); "
                              f"start the run anew")
        if saved.get("reference", "") != reference:
            raise ConfigError(f"dpo.reference_path = {reference!r}: the run's reference log-probs ({path}) were "
                              f"computed from {saved.get('reference') or 'the starting weights'}; keep that reference "
                              f"or start the run anew")
        loss.table = saved["table"].to(trainer.device)
        return f"reference log-probs read from {path}"
    compute = lambda: reference_logps(trainer.step_fn, trainer.train_set, len(pairs), trainer.layout.local_batch,  # noqa: E731
                                      trainer.dims.dp, trainer.dp_rank, trainer.loss_group, trainer.device)
    if reference:  # TRL's ref_model: its weights for this pass, the starting weights back after it
        with weights_from(trainer.model, reference, "dpo.reference_path") as source:
            loss.table = compute()
    else:
        source, loss.table = "the starting weights", compute()
    if trainer.rank == 0:
        os.makedirs(folder, exist_ok=True)
        tmp = f"{path}.{os.getpid()}.tmp"
        torch.save({"fingerprint": pairs.fingerprint, "reference": reference, "table": loss.table.cpu()}, tmp)
        os.replace(tmp, path)  # atomic: a resume reads a whole file or none
    return f"reference log-probs of {len(pairs):,} pairs computed from {source}, saved to {path}"
