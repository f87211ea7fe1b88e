"""Sampling keeps every tensor it combines on the logits' device: the meta device stands in for CUDA on
a CPU-only machine (a tensor on the CPU joined to one on "meta" fails as it would with one on "cuda":
"Tensor on device cpu is not on the expected device meta!"). Before the fix every sampled request and
every GRPO rollout on a GPU failed this way: the serving engine built each row's step count on the
host and `sample` added it to the streams on the device. The model and its slot cache run on meta
here too; only the host reads (`.tolist()`, which meta cannot give) are replaced by fixed values,
after the device part they read from has run."""
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from torchmeg.batching import engine as engine_mod
from torchmeg.batching import sampler
from torchmeg.batching.engine import Engine
from torchmeg.batching.generation import Sampling, sample
from torchmeg.batching.scheduler import Job
from torchmeg.config import load_config
from torchmeg.data.tokenizer import ByteTokenizer
from torchmeg.models import build_model
from torchmeg.train import rollout

META = torch.device("meta")
SAMPLED = Sampling(temperature=1.0, top_p=0.9, top_k=20, min_p=0.01, seed=5)


def test_sample_combines_host_counters_on_the_logits_device():
    """The issue's reproduction: streams and per-row steps made on the host, logits on the device."""
    logits = torch.zeros(2, 10, device=META)
    out = sample(logits, SAMPLED, torch.tensor([1, 2]), torch.tensor([3, 4]), seeds=[0, 1])
    assert out.device == META and out.shape == (2,) and out.dtype == torch.int64
    assert sample(logits, Sampling(), torch.tensor([1, 2]), 0).device == META  # greedy


def _on_meta(monkeypatch, token: int):
    """The engine's host reads replaced: its sampler's device part runs (the tensor read is checked
    to be on meta), then `token` stands in for every number `.tolist()` would read (the tokens, their
    scores, the top pairs)."""
    seen = {"reads": 0, "numbers": 0}

    def read(t):
        assert t.device == META, t.device
        seen["reads"] += 1
        seen["numbers"] += t.numel()
        return torch.full(t.shape, token).tolist()

    def scores(logits, chosen, k):  # (the prompt's log-probs, read apart: none asked for here)
        raise AssertionError("no prompt log-probs were asked for")
    monkeypatch.setattr(sampler, "host_read", read)
    monkeypatch.setattr(sampler, "scores", scores)
    return seen


def _model():
    return build_model(load_config("recipes/debug_llama.toml"), 257, "meta").eval()


def test_sampled_requests_with_penalties_and_logprobs_run_on_the_device(monkeypatch):
    """The serving engine with every sampling setting at once (temperature, top-k, top-p, min-p,
    the repetition, presence and frequency penalties, log-probs of the top 3), beside a greedy row,
    through prefill and decode steps."""
    seen = _on_meta(monkeypatch, token=65)
    engine = Engine(_model(), ByteTokenizer(), META, max_seqs=2, max_len=32, max_queue=2)
    ends = {}
    jobs = [Job([72, 105, 33], 3, SAMPLED, on_event=lambda text, ids, reason: reason and ends.setdefault(0, reason),
                presence=0.5, frequency=0.3, repetition=1.2, logprobs=3),
            Job([1, 2], 3, Sampling(), on_event=lambda text, ids, reason: reason and ends.setdefault(1, reason))]
    for j in jobs:
        engine.submit(j)
    while engine.scheduler.busy():
        engine.step()
    assert ends == {0: "length", 1: "length"}, ends  # (an error would end them "error: ...")
    assert [j.tokens for j in jobs] == [[65] * 3] * 2
    # one read a step (3 steps: the packed prefill's, then 2 decodes), each of both rows' token, log p
    # and top 3 pairs (the greedy row's scored too: the rows are scored together, none uploaded)
    assert seen == {"reads": 3, "numbers": 3 * (2 + 2 + 2 * 3 * 2)}, seen
    assert jobs[0].token_logprobs == [(65, [(65, 65)] * 3)] * 3 and jobs[1].token_logprobs == []
    assert jobs[0].penalty_counts.device == META and jobs[0].repetition_seen.device == META


def test_a_grpo_rollout_runs_on_the_device(monkeypatch):
    """GRPO's rollouts (torchmeg.train.rollout.generate: a group's prompt repeated, its cached prefix
    shared, sampled, processed log-probs scored) on the device."""
    seen = _on_meta(monkeypatch, token=66)
    prompts = [[10, 11, 12, 13, 14, 15, 16, 17]] * 2 + [[20, 21, 22]] * 2
    out, stats = rollout.generate(_model(), ByteTokenizer(), META, prompts, [0, 1, 0, 1], SAMPLED, 2, frozenset({0}))
    assert [r.completion for r in out] == [[66, 66]] * 4
    assert seen["numbers"] == 2 * 8, seen  # every token read with its score (processed, no top pairs)


class _HostTensors(TorchDispatchMode):
    """Counts the tensors made from host data (torch.tensor / as_tensor: aten.lift_fresh), each an
    upload where the logits are on a GPU, and every op dispatched."""

    def __init__(self):
        super().__init__()
        self.uploads, self.ops = 0, 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.uploads += func is torch.ops.aten.lift_fresh.default
        self.ops += 1
        return func(*args, **(kwargs or {}))


MIXED = [Sampling(), Sampling(temperature=0.8, seed=1), Sampling(temperature=1.0, top_p=0.9, seed=2),
         Sampling(temperature=1.3, top_k=5, seed=3), Sampling(temperature=0.7, min_p=0.05, top_k=20, top_p=0.8, seed=4),
         Sampling(temperature=1.0, seed=5), Sampling(), Sampling(temperature=0.5, top_p=0.5, seed=6)]


def _jobs(settings, penalties: bool):
    jobs = []
    for i, s in enumerate(settings):
        extra = dict(presence=0.5 * (i % 2), frequency=0.3 * (i % 3), repetition=(1.0, 1.2, 0.9)[i % 3]) if penalties else {}
        jobs.append(Job([3, 4, i, 99], 16, s, on_event=None, **extra))
        jobs[-1].stream = 1000 + 17 * i
    return jobs


def test_a_step_samples_every_row_in_one_upload_and_one_call(monkeypatch):
    """The engine's sampling of a step (8 rows of 8 different settings, greedy among them, with the
    repetition, presence and frequency penalties), the CPU shadow of its host work on a GPU: ONE
    tensor made from host data (every row's counters, settings and new penalty tokens, packed),
    one sampling call for all rows, at every step (the first builds the penalties' state afresh,
    the later ones add each row's one new token). Before: three uploads per group of rows sharing
    settings (8 here) and two per penalized row, a call per group."""
    calls = []
    real = sampler.sample_each
    monkeypatch.setattr(sampler, "sample_each", lambda *a, **k: calls.append(a[0].shape[0]) or real(*a, **k))
    jobs = _jobs(MIXED, penalties=True)
    g = torch.Generator().manual_seed(0)
    for step in range(4):
        logits = torch.randn(len(jobs), 50, generator=g)
        with _HostTensors() as host:
            nxt = sampler.next_tokens(logits, jobs)
        assert host.uploads == 1, (step, host.uploads)
        for j, t in zip(jobs, nxt.tolist()):
            j.tokens.append(t)
    assert calls == [len(jobs)] * 4


def test_each_row_of_a_mixed_batch_draws_what_it_draws_alone():
    """sample_each's rows are independent: a batch of every setting at once (the engine's) gives each
    row the token `sample` gives it alone (torchmeg.generate's), bit for bit, greedy and sampled, at
    several steps (the counters move), with the penalties too (each row alone through the engine's
    sampler). Compared against the implementation before the one-call sampler on 1,152 rows of 192
    settings (2026-12-06): the same tokens."""
    g = torch.Generator().manual_seed(0)
    together, alone = _jobs(MIXED, True), [_jobs([s], True)[0] for s in MIXED]
    for a, j in zip(alone, together):
        a.prompt, a.stream = j.prompt, j.stream
        a.presence, a.frequency, a.repetition = j.presence, j.frequency, j.repetition
    for step in range(6):
        logits = torch.randn(len(MIXED), 64, generator=g) * 2
        got = sampler.sample_rows(logits, together)
        assert got == [sampler.sample_rows(logits[i:i + 1], [a])[0] for i, a in enumerate(alone)], step
        plain = _jobs(MIXED, False)
        for i, (j, s) in enumerate(zip(plain, MIXED)):
            j.tokens = [5] * step
            assert sampler.sample_rows(logits[i:i + 1], [j])[0] == \
                sample(logits[i:i + 1], s, torch.tensor([j.stream]), step).item()
        for j, a, t in zip(together, alone, got):
            j.tokens.append(t)
            a.tokens.append(t)
    assert len({tuple(j.tokens) for j in together}) > 1


def _scores_before(logits, jobs, new):
    """The engine's scoring before sample_and_score (2026-12-07), the reference: the asking rows and
    their sampled tokens uploaded, scored, read apart from the tokens."""
    want = [i for i, j in enumerate(jobs) if j.logprobs >= 0]
    out = [None] * len(jobs)
    if want:
        x = logits[torch.tensor(want)].float()
        temps = [jobs[i].sampling.temperature if jobs[i].processed_logprobs else 0.0 for i in want]
        if any(temps):
            x = x / torch.tensor([t if t > 0 else 1.0 for t in temps])[:, None]
        got = sampler.scores(x, torch.tensor([new[i] for i in want]), max(jobs[i].logprobs for i in want))
        for i, entry in zip(want, got):
            out[i] = (entry[0], entry[1][:jobs[i].logprobs])
    return out


def test_a_step_reads_its_tokens_and_their_scores_in_one_read(monkeypatch):
    """sample_and_score (the engine's): the tokens sample_rows gives and the scores the engine computed
    before (every row's own top count, 0 to 5, or none; processed log-probs divided by the row's
    temperature, greedy rows by 1; penalties on), bit for bit, over 4 steps — in ONE tensor made from
    host data and ONE host read a step (the CPU shadow of a GPU step's uploads and syncs; before: 3
    uploads and 2 reads when any row asked for log-probs)."""
    reads = []
    real = sampler.host_read
    monkeypatch.setattr(sampler, "host_read", lambda t: reads.append(t.numel()) or real(t))
    jobs, same = _jobs(MIXED, penalties=True), _jobs(MIXED, penalties=True)
    for i, (j, r) in enumerate(zip(jobs, same)):
        j.logprobs = r.logprobs = (-1, 0, 1, 3, 5, -1, 2, 0)[i]
        j.processed_logprobs = r.processed_logprobs = i % 2 == 1
    g = torch.Generator().manual_seed(1)
    for step in range(4):
        logits = torch.randn(len(jobs), 50, generator=g) * 3
        reads.clear()
        with _HostTensors() as host:
            new, scores = sampler.sample_and_score(logits, jobs)
        assert host.uploads == 1 and len(reads) == 1, (step, host.uploads, reads)
        want = sampler.sample_rows(logits, same)
        assert new == want and all(type(t) is int for t in new), step
        assert scores == _scores_before(logits, same, want), step
        assert [s is None for s in scores] == [j.logprobs < 0 for j in jobs]
        assert [len(s[1]) for s in scores if s] == [0, 1, 3, 5, 2, 0]
        for j, r, t in zip(jobs, same, new):
            j.tokens.append(t)
            r.tokens.append(t)
    # no row asking: the tokens alone, as sample_rows reads them
    plain = _jobs(MIXED, penalties=False)
    reads.clear()
    assert sampler.sample_and_score(logits, plain) == (sampler.sample_rows(logits, plain), [None] * len(plain))
    assert reads == [len(plain), len(plain)]
