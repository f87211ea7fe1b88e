"""Sampling keeps every tensor it combines on the logits' device: the meta device stands in for CUDA on
a CPU-only machine (a tensor on the CPU joined to one on "meta" fails as it would with one on "cuda":
"Tensor on device cpu is not on the expected device meta!"). Before the fix every sampled request and
every GRPO rollout on a GPU failed this way: the serving engine built each row's step count on the
host and `sample` added it to the streams on the device. The model and its slot cache run on meta
here too; only the host reads (`.tolist()`, which meta cannot give) are replaced by fixed values,
after the device part they read from has run."""
import torch

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
    """The engine's two host reads replaced: its sampler's device part runs (and is checked to stay
    on meta), then a fixed token / score stands in for what `.tolist()` would read."""
    seen = {"rows": 0, "scored": 0}

    def rows(logits, jobs):
        nxt = sampler.next_tokens(logits, jobs)
        assert logits.device == META and nxt.device == META and nxt.shape == (len(jobs),)
        seen["rows"] += len(jobs)
        return [token] * len(jobs)

    def scores(logits, chosen, k):
        picked, top = sampler.score_tensors(logits, chosen, k)
        assert picked.device == META and (top is None or top.values.device == META)
        seen["scored"] += logits.shape[0]
        return [(0.0, [])] * logits.shape[0]
    monkeypatch.setattr(engine_mod, "sample_rows", rows)
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
    assert seen == {"rows": 6, "scored": 3}, seen
    assert jobs[0].penalty_counts.device == META and jobs[0].repetition_seen.device == META


def test_a_grpo_rollout_runs_on_the_device(monkeypatch):
    """GRPO's rollouts (torchmeg.train.rollout.generate: a group's prompt repeated, its cached prefix
    shared, sampled, processed log-probs scored) on the device."""
    seen = _on_meta(monkeypatch, token=66)
    prompts = [[10, 11, 12, 13, 14, 15, 16, 17]] * 2 + [[20, 21, 22]] * 2
    out, stats = rollout.generate(_model(), ByteTokenizer(), META, prompts, [0, 1, 0, 1], SAMPLED, 2, frozenset({0}))
    assert [r.completion for r in out] == [[66, 66]] * 4
    assert seen == {"rows": 8, "scored": 8}, seen
