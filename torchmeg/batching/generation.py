"""Text generation from a model in torchmeg's interface: prefill, then one token at a time through
the KV cache (torchmeg.models.kv_cache), or by recomputing the whole sequence (the reference the
cache is checked against, and the benchmark's baseline).

Sampling: greedy at temperature 0; else temperature, top-k and top-p (nucleus, Holtzman et al.
2020) shape the distribution and one uniform per row picks the token by inverse CDF. The uniforms
are counter-based (torchmeg.models.init.uniform): row b's draw at step t is a pure function of
(seed, row b's prompt tokens, sample index, t). So a prompt generates the same text alone or in any
batch, every tensor-parallel rank draws the same token from the same (gathered) logits, and no
generator state needs to travel.

A batch of prompts of different lengths is left-padded to one length (KVCache masks the padding
and gives each row its own positions).
"""
from __future__ import annotations

import inspect
import time
import zlib
from dataclasses import dataclass, field

import torch

from torchmeg.config.errors import ConfigError
from torchmeg.models.init import seed_key, uniform
from torchmeg.models.kv_cache import KVCache, varying_shapes

_STEP_BITS = 20  # a row's stream holds 2^20 steps: its key sits above them in the counter


@dataclass(frozen=True)
class Sampling:
    temperature: float = 0.0   # 0: greedy
    top_k: int = 0             # 0: off
    top_p: float = 1.0         # 1: off
    seed: int = 0
    min_p: float = 0.0         # 0: off; else tokens below min_p x the most likely one's probability are dropped

    def check(self) -> None:
        """Bad values -> one line naming the flag."""
        if not (self.temperature >= 0 and self.temperature == self.temperature and self.temperature != float("inf")):
            raise ConfigError(f"--temperature {self.temperature}: must be a finite number >= 0 (0 = greedy)")
        if self.top_k < 0:
            raise ConfigError(f"--top-k {self.top_k}: must be >= 0 (0 = off)")
        if not 0 < self.top_p <= 1:
            raise ConfigError(f"--top-p {self.top_p}: must be in (0, 1] (1 = off)")
        if self.seed < 0:
            raise ConfigError(f"--seed {self.seed}: must be >= 0")
        if not 0 <= self.min_p <= 1:
            raise ConfigError(f"--min-p {self.min_p}: must be in [0, 1] (0 = off)")


def row_streams(prompts: list[list[int]], sample_index: int = 0) -> torch.Tensor:
    """One random stream per row, named by the row's prompt tokens and the sample index."""
    keys = []
    for p in prompts:
        crc = zlib.crc32(torch.tensor(p, dtype=torch.int64).numpy().tobytes())
        keys.append((crc * 1009 + sample_index) % (1 << (62 - _STEP_BITS)))
    return torch.tensor(keys, dtype=torch.int64)


def sample(logits_BV: torch.Tensor, s: Sampling, streams_B: torch.Tensor, step, seeds: list[int] | None = None
           ) -> torch.Tensor:
    """The next token of every row, [B] int64. `seeds`: one per row instead of s.seed (requests that
    differ only in their seed, sampled in one call, each row drawing what its seed alone draws).
    sample_each's arithmetic, every row with the settings `s` (so torchmeg.generate and the serving
    engine, which samples a batch of mixed settings there, give a request the same tokens)."""
    if s.temperature == 0:
        return logits_BV.float().argmax(-1)
    dev, B = logits_BV.device, logits_BV.shape[0]

    def full(value, dtype):  # (a fill on the device: nothing made on the host)
        return torch.full((B,), value, dtype=dtype, device=dev)
    # The counters on the logits' device: streams and per-row steps come from the host (a step a
    # scalar, or a [B] tensor of each row's own step).
    steps = step.to(dev) if torch.is_tensor(step) else full(step, torch.int64)
    keys = full(seed_key(s.seed), torch.int64) if seeds is None else \
        torch.tensor([seed_key(x) for x in seeds], dtype=torch.int64, device=dev)
    return sample_each(logits_BV, full(s.temperature, torch.float32), full(s.top_k, torch.int64),
                       full(s.top_p, torch.float32), full(s.min_p, torch.float32), streams_B.to(dev), steps, keys,
                       SamplingMix.of([s]))


def keep_top_p(probs: torch.Tensor, top_p) -> torch.Tensor:
    """Keep the most likely tokens until their mass reaches top_p (the one crossing it included);
    `top_p` a number, or [B, 1] per row."""
    p_sorted, order = probs.sort(-1, descending=True)
    drop = p_sorted.cumsum(-1) - p_sorted >= top_p
    return torch.zeros_like(probs).scatter_(-1, order, p_sorted.masked_fill(drop, 0.0))


def draw(probs: torch.Tensor, counters: torch.Tensor, key) -> torch.Tensor:
    """One token per row by inverse CDF from the uniform of (key, the row's counter)."""
    cdf = probs.double().cumsum(-1)
    target = (uniform(counters, key) * cdf[:, -1]).unsqueeze(-1)
    return torch.searchsorted(cdf, target).squeeze(-1).clamp_(max=probs.shape[-1] - 1)


def sample_each(logits_BV: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor,
                min_p: torch.Tensor, streams: torch.Tensor, steps: torch.Tensor, keys: torch.Tensor,
                host: "SamplingMix") -> torch.Tensor:
    """`sample` with every row's own settings, [B] tensors on the logits' device (keys: seed_key's of
    each row's seed): one call for a batch of any mix, each row the token `sample` gives it alone (the
    same ops on its elements; a setting a row has off leaves its elements as they were). `host`: which
    settings any row has on (known on the host where the rows were packed: no read here)."""
    logits = logits_BV.float()
    greedy = temperature == 0
    if host.all_greedy:
        return logits.argmax(-1)
    x = logits / torch.where(greedy, 1.0, temperature)[:, None]
    if host.min_p:  # (vLLM's order: after the temperature, before top-k and top-p)
        x = drop_below_min_p(x, min_p[:, None])
    if host.top_k:  # the k-th largest per row (k 0: none dropped)
        k = top_k.clamp(1, x.shape[-1])[:, None]
        kth = torch.where(top_k[:, None] > 0, x.sort(-1, descending=True).values.gather(-1, k - 1), float("-inf"))
        x = x.masked_fill(x < kth, float("-inf"))
    probs = x.softmax(-1)
    if host.top_p:
        probs = torch.where((top_p < 1)[:, None], keep_top_p(probs, top_p[:, None]), probs)
    picked = draw(probs, (streams << _STEP_BITS) + steps, keys)
    return torch.where(greedy, logits.argmax(-1), picked) if host.greedy else picked


@dataclass(frozen=True)
class SamplingMix:
    """Which settings the rows of a batch have on (sample_each's branches, decided on the host)."""
    all_greedy: bool
    greedy: bool
    min_p: bool
    top_k: bool
    top_p: bool

    @classmethod
    def of(cls, settings: list[Sampling]) -> "SamplingMix":
        return cls(all(s.temperature == 0 for s in settings), any(s.temperature == 0 for s in settings),
                   any(s.min_p > 0 and s.temperature for s in settings),
                   any(s.top_k > 0 and s.temperature for s in settings),
                   any(s.top_p < 1 and s.temperature for s in settings))


def penalize_repetition(logits: torch.Tensor, seen: torch.Tensor, penalty: float) -> torch.Tensor:
    """The repetition penalty (Keskar et al. 2019; transformers' RepetitionPenaltyLogitsProcessor and
    vLLM's): the logits of the tokens in `seen` (bool, the logits' shape: the prompt's and the
    generated tokens) divided by `penalty` where positive, multiplied by it elsewhere."""
    return torch.where(seen, torch.where(logits > 0, logits / penalty, logits * penalty), logits)


def _seen(prompts: list[list[int]], vocab: int, device) -> torch.Tensor:
    """[B, vocab] bool: the tokens of each prompt (the repetition penalty's start)."""
    seen = torch.zeros(len(prompts), vocab, dtype=torch.bool, device=device)
    for b, p in enumerate(prompts):
        seen[b, torch.tensor([t for t in p if 0 <= t < vocab], dtype=torch.long, device=device)] = True
    return seen


def drop_below_min_p(x: torch.Tensor, min_p) -> torch.Tensor:
    """min-p sampling (vLLM's and transformers' MinPLogitsWarper): logits [B, V] of the tokens whose
    probability is below min_p (a number, or [B, 1] per row; 0 drops none) x the row's largest set to -inf."""
    probs = x.softmax(-1)
    return x.masked_fill(probs < min_p * probs.max(-1, keepdim=True).values, float("-inf"))


@dataclass
class Generated:
    prompt_tokens: list[int]
    tokens: list[int] = field(default_factory=list)   # new tokens, the end-of-document one excluded
    finish_reason: str = "length"                      # "eos" | "length"
    prefill_ms: float = 0.0                            # of the batch this prompt ran in
    decode_tokens_per_sec: float = 0.0                 # of that batch: tokens after each row's first / time after prefill
    logits: list[torch.Tensor] = field(default_factory=list, repr=False)  # per step, when asked for


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


@torch.no_grad()
def generate(model, prompts: list[list[int]], max_new_tokens: int, eos_id, sampling: Sampling,
             device, use_cache: bool = True, decode_step=None, sample_index: int = 0,
             keep_logits: bool = False, repetition_penalty: float = 1.0) -> list[Generated]:
    """Generate up to `max_new_tokens` per prompt, stopping a row at `eos_id` (an id, or a set of
    ids: a release's generation_config.json may list several; -1 or an empty set: never).
    `repetition_penalty` (1: off) applies to the prompt's and the generated tokens before sampling
    (`keep_logits` keeps the model's logits, before it).

    use_cache=False recomputes the whole sequence at every step, one prompt at a time (a batch
    would need the padding mask only the cache path builds). `decode_step(model, tokens_B1, cache)`
    -> logits [B, V] replaces the eager decode step (a compiled one, over a static cache). Attention
    runs in kernels that build nothing per shape (models.kv_cache.varying_shapes)."""
    with varying_shapes():
        return _generate(model, prompts, max_new_tokens, eos_id, sampling, device, use_cache, decode_step,
                         sample_index, keep_logits, repetition_penalty)


def _generate(model, prompts, max_new_tokens, eos_id, sampling, device, use_cache, decode_step, sample_index,
              keep_logits, penalty) -> list[Generated]:
    device = torch.device(device)
    ends = end_set(eos_id)
    if not use_cache:
        return [_recompute(model, p, max_new_tokens, ends, sampling, device, sample_index, keep_logits, penalty)
                for p in prompts]
    B, P = len(prompts), max(len(p) for p in prompts)
    filler = min(ends, default=0)  # what padding slots and finished rows hold (masked: any valid id does)
    pad = torch.tensor([P - len(p) for p in prompts], dtype=torch.long)
    tokens = torch.tensor([[filler] * (P - len(p)) + list(p) for p in prompts], dtype=torch.long, device=device)
    cache = KVCache(B, P + max_new_tokens, pad, static=decode_step is not None, device=device)
    streams = row_streams(prompts, sample_index)
    out = [Generated(list(p)) for p in prompts]
    t0 = time.perf_counter()
    logits = model(tokens, positions=cache.positions(P), cache=cache, **last_only(model))[:, -1].float()
    cache.advance(P)
    _sync(device)
    prefill_ms, t1, decoded = 1000 * (time.perf_counter() - t0), time.perf_counter(), 0
    done = torch.zeros(B, dtype=torch.bool)
    seen = _seen(prompts, logits.shape[-1], logits.device) if penalty != 1 else None
    for step in range(max_new_tokens):
        nxt = sample(logits if seen is None else penalize_repetition(logits, seen, penalty), sampling, streams, step)
        if seen is not None:
            seen.scatter_(1, nxt[:, None].to(seen.device), True)
        new = nxt.tolist()
        for b, g in enumerate(out):
            if done[b]:
                continue
            decoded += step > 0  # (a row's first token comes from the prefill's logits)
            if keep_logits:
                g.logits.append(logits[b].cpu())
            if new[b] in ends:
                g.finish_reason, done[b] = "eos", True
            else:
                g.tokens.append(new[b])
        if bool(done.all()) or step == max_new_tokens - 1:
            break
        inp = nxt.masked_fill(done.to(nxt.device), filler)[:, None]
        if decode_step is not None:
            logits = decode_step(model, inp, cache).float()
        else:
            logits = model(inp, positions=cache.positions(1), cache=cache)[:, -1].float()
        cache.advance(1)
    _sync(device)
    rate = decoded / max(time.perf_counter() - t1, 1e-9)
    for g in out:
        g.prefill_ms, g.decode_tokens_per_sec = prefill_ms, rate
    return out


def last_only(model) -> dict:
    """The keyword that makes a prefill compute the head on the last position only, where the model
    takes it (torchmeg's families do; a user's model may not): [B, 1, V] logits, not [B, P, V]."""
    return {"last_only": True} if "last_only" in inspect.signature(model.forward).parameters else {}


def decode_one(model, tokens_B1: torch.Tensor, cache: KVCache) -> torch.Tensor:
    """One decode step over a static cache: the same shapes at every position (what compile takes)."""
    return model(tokens_B1, positions=cache.positions(1), cache=cache)[:, -1]


def end_set(eos_id) -> frozenset:
    """`generate`'s eos_id as a set of ids (-1 and negative ids: none)."""
    ids = [eos_id] if isinstance(eos_id, int) else list(eos_id)
    return frozenset(int(i) for i in ids if int(i) >= 0)


def _recompute(model, prompt: list[int], max_new_tokens: int, ends: frozenset, sampling: Sampling, device,
               sample_index: int, keep_logits: bool, penalty: float = 1.0) -> Generated:
    g = Generated(list(prompt))
    streams = row_streams([prompt], sample_index)
    seq = torch.tensor([prompt], dtype=torch.long, device=device)
    t0 = t1 = time.perf_counter()
    seen = None
    for step in range(max_new_tokens):
        logits = model(seq)[:, -1].float()
        if step == 0:
            _sync(device)
            g.prefill_ms, t1 = 1000 * (time.perf_counter() - t0), time.perf_counter()
            seen = _seen([prompt], logits.shape[-1], logits.device) if penalty != 1 else None
        if keep_logits:
            g.logits.append(logits[0].cpu())
        if seen is not None:
            logits = penalize_repetition(logits, seen, penalty)
        nxt = sample(logits, sampling, streams, step)
        if int(nxt) in ends:
            g.finish_reason = "eos"
            break
        g.tokens.append(int(nxt))
        if seen is not None:
            seen.scatter_(1, nxt.view(1, 1).to(seen.device), True)  # (as the cached path marks its rows)
        seq = torch.cat([seq, nxt.view(1, 1)], dim=1)
    _sync(device)
    steps_after_first = len(g.tokens) - (g.finish_reason == "length")
    g.decode_tokens_per_sec = max(steps_after_first, 0) / max(time.perf_counter() - t1, 1e-9)
    return g
