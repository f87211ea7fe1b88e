"""A step's sampling: every row by its own request's parameters (penalties first), all rows in one
call and one upload, and the log-probabilities the requests asked for, computed on the device from the
sampled tokens and read to the host with them in one read (`sample_and_score`: a GPU step's one sync).
The random streams are torchmeg.batching.generation's (prompt tokens, sample index, step), so a
request's tokens are those `torchmeg.generate` gives it alone.
"""
from __future__ import annotations

import struct

import torch

from torchmeg.batching.generation import SamplingMix, penalize_repetition, sample_each
from torchmeg.batching.scheduler import Job
from torchmeg.models.init import seed_key


def sample_rows(logits: torch.Tensor, jobs: list[Job]) -> list[int]:
    """The next token of each row [N, V] for jobs[i]: next_tokens's, in one host read."""
    return host_read(next_tokens(logits, jobs))


def host_read(t: torch.Tensor) -> list:
    """A read of a device tensor to the host (on a GPU a sync: the step waits for its kernels)."""
    return t.tolist()


def sample_and_score(logits: torch.Tensor, jobs: list[Job]) -> tuple[list[int], list]:
    """A step's sampling and scoring: (the next token of each row, per row (log p(token), the top k
    (token, log p) pairs) for the jobs that asked, None for the others), as `sample_rows` and the
    scores of `score_tensors` (the logits' log-softmax, divided by the temperature first for a job
    with processed_logprobs, as RL compares them). One upload (next_tokens' buffer, which carries each
    row's divisor too) and ONE host read: the scores are computed on the device from the sampled
    tokens and read with them, packed as float64 (token ids exactly: < 2^53). Before: the sampled ids
    read, then uploaded again with the rows that asked, their scores read: two uploads more, two syncs."""
    if all(_plain_greedy(j) for j in jobs):  # (vLLM's all-greedy path: the argmax, nothing uploaded)
        return host_read(logits.argmax(-1)), [None] * len(jobs)
    tokens, divisor = _sample(logits, jobs)
    want = [i for i, j in enumerate(jobs) if j.logprobs >= 0]
    if not want:
        return host_read(tokens), [None] * len(jobs)
    k = max(jobs[i].logprobs for i in want)
    picked, top = score_tensors(logits.float() / divisor[:, None], tokens, k)  # (every row: no index uploaded)
    # a row per job: [token, log p(token), the top k's values, their token ids]
    cols = [tokens.double()[:, None], picked.double()[:, None]]
    if top is not None:
        cols += [top.values.double(), top.indices.double()]
    rows = host_read(torch.cat(cols, 1))
    width = top.values.shape[-1] if top is not None else 0
    out = [None] * len(jobs)
    for i in want:
        r, n = rows[i], jobs[i].logprobs
        out[i] = (r[1], [(int(t), v) for t, v in zip(r[2 + width:2 + width + n], r[2:2 + n])])
    return [int(r[0]) for r in rows], out


def _plain_greedy(job: Job) -> bool:
    """Greedy with nothing to apply first (no penalty) and no log-probs asked: its token is the argmax
    (sample_each's greedy rows give the same: penalties are what it would change the logits by)."""
    return (job.sampling.temperature == 0 and job.logprobs < 0 and job.repetition == 1
            and not job.presence and not job.frequency)


def next_tokens(logits: torch.Tensor, jobs: list[Job]) -> torch.Tensor:
    """The next token of each row [N, V] for jobs[i], [N] int64 on the logits' device, in one upload:
    every row's counters and settings and the tokens its penalties add since the last step, packed
    into one int64 buffer on the host and copied once (batching.generation.sample_each then samples
    every row, whatever its settings, in one call; the penalties apply per row to slices of the
    buffer). tests/test_sampling_device.py runs it on the meta device, which stands in for CUDA,
    and counts the tensors it makes from host data."""
    return _sample(logits, jobs)[0]


def _sample(logits: torch.Tensor, jobs: list[Job]) -> tuple[torch.Tensor, torch.Tensor]:
    """next_tokens' tokens and, from the same upload, each row's log-prob divisor [N] (its temperature
    for a job with processed_logprobs and a temperature, else 1)."""
    n, vocab, dev = len(jobs), logits.shape[-1], logits.device
    floats = [x for j in jobs for x in (j.sampling.temperature, j.sampling.top_p, j.sampling.min_p,
                                        j.sampling.temperature if j.processed_logprobs and j.sampling.temperature > 0 else 1.0)]
    data = [x for j in jobs for x in (j.stream, len(j.tokens), seed_key(j.sampling.seed), j.sampling.top_k)]
    data += struct.unpack(f"<{len(floats)}q", struct.pack(f"<{len(floats)}d", *floats))
    penalties = []  # (row, (offset, length, fresh) of its repetition mask's tokens, the same of its counts')
    for i, job in enumerate(jobs):
        counted = bool((job.presence or job.frequency) and job.tokens)
        if job.repetition == 1 and not counted:
            continue
        seen = counts = None
        if job.repetition != 1:  # the prompt's and the generated tokens (all of them on a fresh mask)
            fresh = _stale(job.repetition_seen, job.repetition_counted, job, vocab, dev)
            add = ([t for t in job.prompt if 0 <= t < vocab] if fresh else []) + \
                job.tokens[0 if fresh else job.repetition_counted:]
            seen = (len(data), len(add), fresh)
            data += add
        if counted:  # the generated tokens counted since the last step
            fresh = _stale(job.penalty_counts, job.penalty_counted, job, vocab, dev)
            add = job.tokens[0 if fresh else job.penalty_counted:]
            counts = (len(data), len(add), fresh)
            data += add
        penalties.append((i, seen, counts))
    buf = torch.tensor(data, dtype=torch.int64).to(dev, non_blocking=True)  # the step's one upload
    if penalties:  # vLLM's order: the repetition penalty, then OpenAI's frequency and presence
        logits = logits.clone()
        for i, seen, counts in penalties:
            job = jobs[i]
            if seen is not None:  # over the prompt's and the generated tokens: positive / p, others x p
                logits[i] = penalize_repetition(logits[i], repetition_mask(job, vocab, buf, seen), job.repetition)
            if counts is not None:  # logit -= frequency x count + presence x (count > 0)
                c = penalty_counts(job, vocab, buf, counts)
                logits[i] -= job.frequency * c + job.presence * (c > 0).float()
    rows = buf[:4 * n].view(n, 4)
    settings = buf[4 * n:8 * n].view(torch.float64).view(n, 4).float()
    return sample_each(logits, settings[:, 0], rows[:, 3], settings[:, 1], settings[:, 2], rows[:, 0], rows[:, 1],
                       rows[:, 2], SamplingMix.of([j.sampling for j in jobs])), settings[:, 3]


def _stale(kept, counted: int, job: Job, vocab: int, device) -> bool:
    """Whether a job's kept penalty state must be made afresh (none yet, another device or vocabulary,
    or tokens taken back since it was counted)."""
    return kept is None or kept.device != device or kept.shape[0] != vocab or counted > len(job.tokens)


def penalty_counts(job: Job, vocab: int, buf: torch.Tensor, at: tuple[int, int, bool]) -> torch.Tensor:
    """How often each token occurs among the job's generated tokens, [vocab] on the device: kept on the
    job and updated with the tokens generated since the last step (one or a few a step, at buf[offset:
    offset + length]), not rebuilt from the whole list each step."""
    offset, length, fresh = at
    counts = torch.zeros(vocab, device=buf.device) if fresh else job.penalty_counts
    if length:
        counts.index_add_(0, buf[offset:offset + length], torch.ones(length, device=buf.device))
    job.penalty_counts, job.penalty_counted = counts, len(job.tokens)
    return counts


def repetition_mask(job: Job, vocab: int, buf: torch.Tensor, at: tuple[int, int, bool]) -> torch.Tensor:
    """[vocab] bool on the device: the tokens of the job's prompt or generated so far (vLLM's and
    transformers' repetition penalty), kept on the job and updated with the new tokens (at
    buf[offset:offset + length]; a fresh mask: the prompt's and every generated one)."""
    offset, length, fresh = at
    mask = torch.zeros(vocab, dtype=torch.bool, device=buf.device) if fresh else job.repetition_seen
    if length:
        mask.index_fill_(0, buf[offset:offset + length], True)  # (a Scalar: no tensor made on the host)
    job.repetition_seen, job.repetition_counted = mask, len(job.tokens)
    return mask


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
