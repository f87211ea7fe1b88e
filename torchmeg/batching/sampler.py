"""A step's sampling: every row by its own request's parameters (penalties first), rows that share
them in one call, and the log-probabilities the requests asked for. The random streams are
torchmeg.batching.generation's (prompt tokens, sample index, step), so a request's tokens are those
`torchmeg.generate` gives it alone.
"""
from __future__ import annotations

import dataclasses

import torch

from torchmeg.batching.generation import Sampling, penalize_repetition, sample
from torchmeg.batching.scheduler import Job


def sample_rows(logits: torch.Tensor, jobs: list[Job]) -> list[int]:
    """The next token of each row [N, V] for jobs[i]: next_tokens's, in one host read."""
    return next_tokens(logits, jobs).tolist()


def next_tokens(logits: torch.Tensor, jobs: list[Job]) -> torch.Tensor:
    """The next token of each row [N, V] for jobs[i], [N] int64 on the logits' device (every tensor it
    combines made there or moved there: tests/test_sampling_device.py runs it on the meta device, which
    stands in for CUDA). Rows whose sampling differs only in its seed (unseeded requests each draw one)
    share one call, each row with its own seed."""
    nxt = torch.empty(len(jobs), dtype=torch.long, device=logits.device)
    penalized = [i for i, j in enumerate(jobs) if ((j.presence or j.frequency) and j.tokens) or j.repetition != 1]
    if penalized:  # vLLM's order: the repetition penalty, then OpenAI's frequency and presence
        logits = logits.clone()
        for i in penalized:
            job = jobs[i]
            if job.repetition != 1:  # over the prompt's and the generated tokens: positive / p, others x p
                logits[i] = penalize_repetition(logits[i], repetition_mask(job, logits.shape[-1], logits.device),
                                                job.repetition)
            if (job.presence or job.frequency) and job.tokens:  # logit -= frequency x count + presence x (count > 0)
                counts = penalty_counts(job, logits.shape[-1], logits.device)
                logits[i] -= job.frequency * counts + job.presence * (counts > 0).float()
    groups: dict[Sampling, list[int]] = {}
    for i, job in enumerate(jobs):
        groups.setdefault(dataclasses.replace(job.sampling, seed=0), []).append(i)
    for s, idx in groups.items():
        rows = torch.tensor(idx, device=logits.device)
        streams = torch.tensor([jobs[i].stream for i in idx], dtype=torch.long)
        steps = torch.tensor([len(jobs[i].tokens) for i in idx], dtype=torch.long)
        nxt[rows] = sample(logits[rows], s, streams, steps, seeds=[jobs[i].sampling.seed for i in idx])
    return nxt


def penalty_counts(job: Job, vocab: int, device: torch.device) -> torch.Tensor:
    """How often each token occurs among the job's generated tokens, [vocab] on the device: kept on the
    job and updated with the tokens generated since the last step (one or a few a step), not rebuilt
    from the whole list each step."""
    counts = job.penalty_counts
    if counts is None or counts.device != device or counts.shape[0] != vocab or job.penalty_counted > len(job.tokens):
        counts, job.penalty_counted = torch.zeros(vocab, device=device), 0
    new = job.tokens[job.penalty_counted:]
    if new:
        counts.index_add_(0, torch.tensor(new, device=device), torch.ones(len(new), device=device))
    job.penalty_counts, job.penalty_counted = counts, len(job.tokens)
    return counts


def repetition_mask(job: Job, vocab: int, device: torch.device) -> torch.Tensor:
    """[vocab] bool on the device: the tokens of the job's prompt or generated so far (vLLM's and
    transformers' repetition penalty), kept on the job and updated with the new tokens."""
    mask, counted = job.repetition_seen, job.repetition_counted
    if mask is None or mask.device != device or mask.shape[0] != vocab or counted > len(job.tokens):
        mask, counted = torch.zeros(vocab, dtype=torch.bool, device=device), 0
        mask[torch.tensor([t for t in job.prompt if 0 <= t < vocab], dtype=torch.long, device=device)] = True
    new = job.tokens[counted:]
    if new:
        mask[torch.tensor(new, dtype=torch.long, device=device)] = True
    job.repetition_seen, job.repetition_counted = mask, len(job.tokens)
    return mask


def token_logprobs(logits: torch.Tensor, jobs: list[Job], new: list[int]) -> list:
    """Per row, (the sampled token's log-probability, the top k (token, log-probability) pairs) for
    the jobs that asked (None for the others): the logits' log-softmax (divided by the temperature
    for a job with processed_logprobs), one host read."""
    want = [i for i, j in enumerate(jobs) if j.logprobs >= 0]
    out = [None] * len(jobs)
    if want:
        rows = torch.tensor(want, device=logits.device)
        chosen = torch.tensor([new[i] for i in want], device=logits.device)
        x = logits[rows].float()
        temps = [jobs[i].sampling.temperature if jobs[i].processed_logprobs else 0.0 for i in want]
        if any(temps):  # processed: of the distribution sampled from (temperature applied), as RL compares them
            x = x / torch.tensor([t if t > 0 else 1.0 for t in temps], device=x.device)[:, None]
        for i, entry in zip(want, scores(x, chosen, max(jobs[i].logprobs for i in want))):
            out[i] = (entry[0], entry[1][:jobs[i].logprobs])
    return out


def prompt_logprobs(logits_nV: torch.Tensor, job: Job, start: int) -> list:
    """A prompt chunk's logits (positions start.. of the prompt): each following prompt token's
    log-probability given those before it (the chunk's last position predicts a prompt token only
    while the prompt goes on)."""
    target = job.prompt[start + 1:start + 1 + logits_nV.shape[0]]
    if not target:
        return []
    chosen = torch.tensor(target, device=logits_nV.device)
    return [(lp, top[:job.logprobs]) for lp, top in scores(logits_nV[:len(target)].float(), chosen, job.logprobs)]


def scores(logits_NV: torch.Tensor, chosen_N: torch.Tensor, k: int) -> list:
    """[(log p(chosen), [(token, log p)] of the k most likely, best first)] per row (score_tensors's,
    read to the host)."""
    picked, top = score_tensors(logits_NV, chosen_N, k)
    picked = picked.tolist()
    if top is None:
        return [(p, []) for p in picked]
    values, ids = top.values.tolist(), top.indices.tolist()
    return [(p, list(zip(i, v))) for p, i, v in zip(picked, ids, values)]


def score_tensors(logits_NV: torch.Tensor, chosen_N: torch.Tensor, k: int):
    """On the logits' device: log p(chosen) [N] and the k most likely (topk's values and indices, or
    None for k = 0)."""
    lp = logits_NV.float().log_softmax(-1)
    return lp.gather(-1, chosen_N[:, None])[:, 0], (lp.topk(min(k, lp.shape[-1]), dim=-1) if k else None)
