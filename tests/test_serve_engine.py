"""The serving engine in process (torchmeg.batching.scheduler, no HTTP): every family, sequences joining
and leaving the continuous batch, each gets the tokens `generate` gives it alone; the KV cache is
allocated at start; log-probs and penalties are the model's and OpenAI's. The HTTP server against
the `openai` client: tests/test_serve.py.
"""
import pytest
import torch

from conftest import FP32_PARITY, assert_tensor_close
from torchmeg.config.schema import load_config
from torchmeg.data.tokenizer import ByteTokenizer
from torchmeg.batching.generation import Sampling, generate
from torchmeg.models import build_model, materialize
from torchmeg.models.args import model_args
from torchmeg.batching.engine import Engine
from torchmeg.batching.scheduler import Job


@pytest.mark.parametrize("name,dtype", [("llama", torch.float32), ("gpt2", torch.float32), ("moe", torch.float32),
                                        ("deepseek_v3", torch.float32), ("gpt_oss", torch.float32), ("llama", torch.bfloat16),
                                        ("hf", torch.float32)])
def test_continuous_batch_gives_each_sequence_its_tokens_alone(name, dtype):
    """Three slots, five sequences of different prompt and output lengths, greedy and seeded: some
    wait for a slot, one arrives while the others decode, long prompts take a step each (the
    prefill budget). Each gets the tokens torchmeg's `generate` gives it alone; in bf16 the cache
    and the logits are bf16 (what ran, not only what was asked). `hf` (transformers' Llama): its
    attention over the same pool (models.hf_paged), where `generate` runs transformers' own cache."""
    cfg = load_config("recipes/hf_llama_debug.toml") if name == "hf" else \
        load_config("recipes/debug_llama.toml", [f"--model.name={name}", "--model.flavor=debug"])
    model = materialize(build_model(cfg, 257, "meta"), "cpu", seed=0).eval().to(dtype)
    prompts = [list(range(5, 12)), [40, 41, 42], [100], list(range(60, 75)), [7, 8]]
    lengths = [10, 6, 12, 5, 9]
    sampling = [Sampling(), Sampling(temperature=0.9, top_k=40, seed=4), Sampling(), Sampling(temperature=1.1, seed=1),
                Sampling(top_p=0.5, temperature=0.7, seed=2)]
    engine = Engine(model, ByteTokenizer(), "cpu", max_seqs=3, max_len=48, max_queue=8, prefill_tokens=8)
    got, jobs = {}, []
    for i, (p, n, s) in enumerate(zip(prompts, lengths, sampling)):
        jobs.append(Job(p, n, s, on_event=lambda text, ids, reason, i=i: got.setdefault(i, []).extend(ids)))
    for j in jobs[:4]:
        engine.submit(j)
    steps = 0
    while engine.running or engine.waiting or steps < 3:
        engine.step()
        steps += 1
        if steps == 2:
            engine.submit(jobs[4])  # arrives mid-run
    assert steps < sum(lengths) - 4 and all(j.finish_reason == "length" for j in jobs)
    for i, (p, n, s) in enumerate(zip(prompts, lengths, sampling)):
        alone = generate(model, [p], n, -1, s, "cpu")[0].tokens
        assert got[i] == jobs[i].tokens and len(got[i]) == n
        # bf16: a matmul's rounding depends on how many rows it runs (batch variance), and a
        # random model's near-ties flip on it; what is exact there is the prefill (one sequence).
        assert (got[i] if dtype == torch.float32 else got[i][:1]) == (alone if dtype == torch.float32 else alone[:1]), \
            (i, got[i], alone)
    # the pool: the null block and what 3 sequences of 48 positions fill, blocks of 16 positions
    cache = engine.cache.layers[next(iter(engine.cache.layers))]
    assert not engine.own_cache and cache.k.dtype == dtype and cache.k.shape[1] == (1 + 3 * 3) * 16
    assert engine.pool.used() == 0
    full = model(torch.tensor([prompts[0]]))
    last = model(torch.tensor([prompts[0]]), last_only=True)
    # the same numbers, the head's matmul over 1 row instead of 7 (another summation order): the
    # format's rule, fp32 1e-5 / bf16 one rounding of the output (2^-8) relative to the logits' scale
    assert last.shape == (1, 1, full.shape[-1])
    assert_tensor_close(last.float(), full[:, -1:].float(), FP32_PARITY if dtype == torch.float32 else 2 ** -8, "last_only")


def test_a_kv_cache_that_does_not_fit_fails_at_start_in_one_line():
    """`Engine.reserve` allocates the KV pool at start (the server calls it before listening): a size the
    machine cannot hold is a ConfigError naming the flag, not an error at the first request."""
    from torchmeg.config.errors import ConfigError
    cfg = load_config("recipes/debug_llama.toml")
    model = materialize(build_model(cfg, 257, "meta"), "cpu", seed=0).eval()
    a = model_args(cfg, 257)
    # k, v x layers x (the null block + 2 sequences x 4 blocks) x 16 positions x kv heads x dim x fp32
    assert Engine(model, ByteTokenizer(), "cpu", max_seqs=2, max_len=64, max_queue=1).reserve() == \
        2 * a.n_layers * (1 + 2 * 4) * 16 * a.kv_heads * a.head_dim * 4
    # 2^54 bytes a pool: more than any machine holds, refused by the allocator before a page is touched
    with pytest.raises(ConfigError, match=r"^a KV pool of 137438953472 blocks does not fit .*; lower --kv-cache-gib$"):
        Engine(model, ByteTokenizer(), "cpu", max_seqs=1024, max_len=2 ** 36, max_queue=1, num_blocks=2 ** 37).reserve()


@pytest.mark.parametrize("budget", [2048, 8])
def test_engine_log_probs_are_the_models(budget):
    """A job asking for log-probs (top 3) and its prompt's (echo), among others that do not: the prompt
    tokens' log-probs = log_softmax of one forward over the prompt, each generated token's = that of the
    forward over everything before it (the raw logits, whatever the sampling), the top 3 sorted and led by
    the token's own under greedy; max_tokens 0 scores the prompt and generates nothing. With a budget of
    8 prompt tokens a step the 27-token prompt is scored chunk by chunk, each chunk over the ones before."""
    cfg = load_config("recipes/debug_llama.toml")
    model = materialize(build_model(cfg, 257, "meta"), "cpu", seed=0).eval()
    engine = Engine(model, ByteTokenizer(), "cpu", max_seqs=3, max_len=64, max_queue=8, prefill_tokens=budget)
    prompt = list(b"def parse(text):\n    return")
    jobs = [Job(prompt, 6, Sampling(), on_event=lambda *a: None, logprobs=3, prompt_logprobs=True),
            Job(prompt, 6, Sampling(temperature=1.0, seed=7), on_event=lambda *a: None, logprobs=0),
            Job(list(b"import os"), 4, Sampling(), on_event=lambda *a: None),
            Job(prompt, 0, Sampling(), on_event=lambda *a: None, logprobs=1, prompt_logprobs=True)]
    for j in jobs:
        engine.submit(j)
    while engine.running or engine.waiting:
        engine.step()
    with torch.no_grad():
        for j in jobs[:2]:
            seq = torch.tensor([prompt + j.tokens])
            lp = model(seq)[0].log_softmax(-1)
            want = lp[torch.arange(seq.shape[1] - 1), seq[0, 1:]]
            got = [v for v, _ in j.prompt_token_logprobs] + [v for v, _ in j.token_logprobs]
            got = got if j.prompt_logprobs else want[:len(prompt) - 1].tolist() + got
            assert_tensor_close(torch.tensor(got), want, FP32_PARITY, "log-probs")
            assert len(j.token_logprobs) == 6 and all(len(top) == j.logprobs for _, top in j.token_logprobs)
        for t, (v, top) in zip(jobs[0].tokens, jobs[0].token_logprobs):
            assert top[0] == (t, v) and [x for _, x in top] == sorted((x for _, x in top), reverse=True)
    assert jobs[3].tokens == [] and jobs[3].finish_reason == "length"
    assert [v for v, _ in jobs[3].prompt_token_logprobs] == [v for v, _ in jobs[0].prompt_token_logprobs]
    assert jobs[2].token_logprobs == [] and jobs[2].tokens


def test_engine_penalties_are_openais():
    """presence / frequency penalties (OpenAI's rule: logit - frequency x count - presence x (count > 0),
    over the tokens generated so far): greedy tokens = a decode loop applying the rule by hand, and
    different from the unpenalised ones; a job without penalties in the same steps is unaffected."""
    cfg = load_config("recipes/debug_llama.toml")
    model = materialize(build_model(cfg, 257, "meta"), "cpu", seed=0).eval()
    engine = Engine(model, ByteTokenizer(), "cpu", max_seqs=2, max_len=64, max_queue=4)
    prompt = list(b"aaaa")
    jobs = _drain(engine, [Job(prompt, 12, Sampling(), on_event=lambda *a: None, presence=0.5, frequency=1.5),
                           Job(prompt, 12, Sampling(), on_event=lambda *a: None)])
    with torch.no_grad():
        seq = list(prompt)
        for _ in range(12):
            logits = model(torch.tensor([seq]))[0, -1].float()
            counts = torch.bincount(torch.tensor(seq[len(prompt):], dtype=torch.long), minlength=logits.shape[0])
            seq.append(int((logits - 1.5 * counts - 0.5 * (counts > 0).float()).argmax()))
    assert jobs[0].tokens == seq[len(prompt):] and jobs[0].tokens != jobs[1].tokens
    assert jobs[1].tokens == generate(model, [prompt], 12, -1, Sampling(), "cpu")[0].tokens


def test_repetition_penalty_and_min_p_are_transformers_processors():
    """vLLM's repetition penalty (over the prompt's and the generated tokens: a positive logit / p, the
    others x p) = transformers' RepetitionPenaltyLogitsProcessor on prompt + generated: greedy engine
    tokens = a decode loop applying transformers' processor, and differ from the unpenalised ones, with
    OpenAI's frequency penalty after it (vLLM's order); min-p = transformers' MinPLogitsWarper, the same
    tokens dropped, and a seeded engine sample with min_p = 0.3 never draws one of them."""
    from transformers.generation.logits_process import MinPLogitsWarper, RepetitionPenaltyLogitsProcessor
    from torchmeg.batching.generation import drop_below_min_p
    cfg = load_config("recipes/debug_llama.toml")
    model = materialize(build_model(cfg, 257, "meta"), "cpu", seed=0).eval()
    engine = Engine(model, ByteTokenizer(), "cpu", max_seqs=2, max_len=64, max_queue=4)
    prompt = list(b"abcabcab")
    jobs = _drain(engine, [Job(prompt, 12, Sampling(), on_event=lambda *a: None, repetition=1.3, frequency=0.2),
                           Job(prompt, 12, Sampling(), on_event=lambda *a: None)])
    rep = RepetitionPenaltyLogitsProcessor(1.3)
    with torch.no_grad():
        seq = list(prompt)
        for _ in range(12):
            logits = rep(torch.tensor([seq]), model(torch.tensor([seq]))[:, -1].float())[0]
            counts = torch.bincount(torch.tensor(seq[len(prompt):], dtype=torch.long), minlength=logits.shape[0])
            seq.append(int((logits - 0.2 * counts).argmax()))
    assert jobs[0].tokens == seq[len(prompt):] and jobs[0].tokens != jobs[1].tokens
    # min-p: the same tokens dropped as transformers' warper drops (at a temperature)
    x = torch.randn(4, 257, generator=torch.Generator().manual_seed(0)) * 3
    for min_p in (0.05, 0.3):
        want = MinPLogitsWarper(min_p)(None, x.clone()).isinf()
        got = drop_below_min_p(x, min_p).isinf()
        assert torch.equal(got, want) and 0 < got.sum() < got.numel(), min_p
    logits = model(torch.tensor([prompt]))[0, -1].float()
    allowed = ~drop_below_min_p(logits[None] / 1.5, 0.3)[0].isinf()
    drawn = {t for seed in range(40) for t in _first_token(engine, prompt, Sampling(1.5, 0, 1.0, seed, 0.3))}
    free = {t for seed in range(40) for t in _first_token(engine, prompt, Sampling(1.5, 0, 1.0, seed))}
    assert drawn and all(allowed[t] for t in drawn) and not all(allowed[t] for t in free), (drawn, free)


def _first_token(engine, prompt, sampling) -> list[int]:
    return _drain(engine, [Job(prompt, 1, sampling, on_event=lambda *a: None)])[0].tokens


def _drain(engine, jobs: list[Job]) -> list[Job]:
    """Submit the jobs and step the engine until every one has finished."""
    for job in jobs:
        engine.submit(job)
    while engine.running or engine.waiting:
        engine.step()
    return jobs


def test_penalty_counts_grow_with_each_step_and_seeds_share_one_sampling_call(monkeypatch):
    """The penalties' counts are kept on the job and updated with each step's new token (one element
    added a step, not the whole list again: O(new), not O(n^2) over a completion), equal to a bincount
    of the tokens; rows of different seeds (unseeded requests each draw one) and settings sample in
    ONE call, each row's token the one it draws alone."""
    from torchmeg.batching import sampler
    V, added = 50, []
    real_add = torch.Tensor.index_add_
    monkeypatch.setattr(torch.Tensor, "index_add_", lambda t, d, i, src: added.append(len(i)) or real_add(t, d, i, src))
    job = Job([1, 2], 20, Sampling(), on_event=None, presence=0.5, frequency=1.0)
    g = torch.Generator().manual_seed(0)
    for step in range(12):
        logits = torch.randn(1, V, generator=g)
        job.tokens.append(sampler.sample_rows(logits, [job])[0])
    assert added == [1] * 11  # (the first step has no generated token yet)
    assert torch.equal(job.penalty_counts, torch.bincount(torch.tensor(job.tokens[:-1]), minlength=V).float())
    monkeypatch.setattr(torch.Tensor, "index_add_", real_add)
    calls = []
    real_sample = sampler.sample_each
    monkeypatch.setattr(sampler, "sample_each", lambda *a, **k: calls.append(a[0].shape[0]) or real_sample(*a, **k))
    seeds = [11, 12, 13, 14, 15]
    jobs = [Job([3, 4, i], 8, Sampling(temperature=1.0, top_p=0.9, seed=sd), on_event=None) for i, sd in enumerate(seeds)]
    jobs[1].sampling = Sampling(temperature=0.7, top_k=5, seed=12)  # (other settings, the same call)
    for j in jobs:
        j.tokens = [7] * 3
    logits = torch.randn(len(jobs), V, generator=g)
    together = sampler.sample_rows(logits, jobs)
    assert calls == [len(jobs)]
    alone = [sampler.sample_rows(logits[i:i + 1], [j])[0] for i, j in enumerate(jobs)]
    assert together == alone and len(set(together)) > 1  # (different seeds draw differently here)


def test_every_cancelled_job_hears_its_end_and_gives_its_place_back():
    """A cancelled job, running or waiting, ends with one event ("abort") and leaves the scheduler; the
    others run to their end. (The engine used to drop a cancelled job without an event: the API process,
    which forgets a request only on its last event, kept counting it against the queue for good.)"""
    cfg = load_config("recipes/debug_llama.toml")
    model = materialize(build_model(cfg, 257, "meta"), "cpu", seed=0).eval()
    engine = Engine(model, ByteTokenizer(), "cpu", max_seqs=1, max_len=64, max_queue=3)
    ends = {}
    jobs = [Job([5 + i, 6, 7], 6, Sampling(), on_event=lambda text, ids, reason, i=i: reason and ends.setdefault(
        i, []).append(reason)) for i in range(3)]
    for j in jobs:
        engine.submit(j)
    engine.step()
    engine.step()
    engine.cancel(jobs[0])  # running
    engine.cancel(jobs[2])  # waiting behind jobs[1]
    while engine.running or engine.waiting:
        engine.step()
    assert ends == {0: ["abort"], 1: ["length"], 2: ["abort"]}
    assert len(jobs[1].tokens) == 6 and not engine.scheduler.take_dropped()


def test_a_cancel_racing_a_finish_is_harmless():
    """The relay's reader cancels by key while the engine's thread pops finished jobs: the pop between
    the reader's look-up and its read must not raise (a KeyError there ended the thread that reads
    requests, and the server hung without exiting)."""
    from torchmeg.serving.relay import cancel

    class Racing(dict):  # the key is there when asked, gone when read: the finish fell in between
        def __contains__(self, key):
            return True

        def __getitem__(self, key):
            raise KeyError(key)

        def get(self, key, default=None):
            return default

    cancelled = []
    engine = type("E", (), {"cancel": lambda self, job: cancelled.append(job)})()
    cancel(engine, Racing(), 7)
    cancel(engine, {3: "job"}, 3)
    assert cancelled == ["job"]


@pytest.mark.parametrize("name", ["llama", "deepseek_v3", "gpt_oss"])
def test_prompts_sharing_a_prefix_compute_it_once_and_get_their_tokens_alone(name):
    """Prefix caching: a burst of prompts after one 70-token system prompt (the first computes it, the
    rest wait one step and copy its 64 whole-block tokens), two more arriving while those decode (copied
    from a running sequence), a prompt sharing only 10 tokens (under a block: computed whole), an echo
    request (every position scored: computed whole), a long prompt chunked by the budget. Each gets the
    tokens `generate` gives it alone, greedy and seeded; with prefix caching off, the same tokens and
    nothing copied. (gpt_oss: sliding windows and sinks; deepseek_v3: MLA's latent cache.)"""
    cfg = load_config("recipes/debug_llama.toml", [f"--model.name={name}", "--model.flavor=debug"])
    model = materialize(build_model(cfg, 257, "meta"), "cpu", seed=0).eval()
    g = torch.Generator().manual_seed(3)
    system = torch.randint(0, 256, (70,), generator=g).tolist()
    tail = lambda n: torch.randint(0, 256, (n,), generator=g).tolist()  # noqa: E731
    prompts = [system + tail(5 + i) for i in range(5)] + [system[:10] + tail(60), system + tail(3)]
    prompts.append(system + tail(100))  # longer than the budget: chunked, after its copied prefix
    late = [system + tail(7), system[:40] + tail(9)]
    sampling = [Sampling(temperature=0.9, seed=i) if i % 2 else Sampling() for i in range(len(prompts) + len(late))]
    results = {}
    for caching in (True, False):
        engine = Engine(model, ByteTokenizer(), "cpu", max_seqs=8, max_len=192, max_queue=16, prefill_tokens=64,
                        prefix_caching=caching)
        jobs = [Job(p, 6, s, on_event=lambda *e: None, prompt_logprobs=(i == 6), logprobs=0 if i == 6 else -1)
                for i, (p, s) in enumerate(zip(prompts + late, sampling))]
        for j in jobs[:len(prompts)]:
            engine.submit(j)
        steps = 0
        while engine.running or engine.waiting:
            engine.step()
            steps += 1
            if steps == 4:
                for j in jobs[len(prompts):]:
                    engine.submit(j)
        results[caching] = [j.tokens for j in jobs], [j.cached_prompt for j in jobs]
    tokens, cached = results[True]
    assert cached == [0, 64, 64, 64, 64, 0, 0, 64, 64, 32], cached
    assert results[False] == (tokens, [0] * len(cached))
    for i, (p, s) in enumerate(zip(prompts + late, sampling)):
        assert tokens[i] == generate(model, [p], 6, -1, s, "cpu")[0].tokens, i


def test_a_finished_sequences_cache_serves_the_next_request_and_the_next_turn():
    """One request at a time (a client that waits for each answer: lm-eval at batch 1, a chat): what
    a finished sequence's slot still holds — its prompt and what it generated — is the next prompt's
    prefix, with nothing to copy (the next one takes the same slot); each answer = `generate` alone."""
    cfg = load_config("recipes/debug_llama.toml")
    model = materialize(build_model(cfg, 257, "meta"), "cpu", seed=0).eval()
    g = torch.Generator().manual_seed(5)
    system = torch.randint(0, 256, (50,), generator=g).tolist()
    engine = Engine(model, ByteTokenizer(), "cpu", max_seqs=4, max_len=256, max_queue=4)

    def ask(prompt, n=12):
        job = Job(prompt, n, Sampling(), on_event=lambda *e: None)
        engine.submit(job)
        while engine.running or engine.waiting:
            engine.step()
        assert job.tokens == generate(model, [prompt], n, -1, Sampling(), "cpu")[0].tokens
        return job
    first = ask(system + [1, 2, 3])
    assert first.cached_prompt == 0
    second = ask(system + [4, 5], 20)  # the same slot: the prefix is there already
    assert second.cached_prompt == 48 and second.slot == first.slot
    turn = ask(second.prompt + second.tokens + [9] * 20)  # the next turn: prompt, answer, a new question
    assert turn.cached_prompt == (len(second.prompt) + len(second.tokens) - 1) // 16 * 16 == 64
    other = ask(torch.randint(0, 256, (40,), generator=g).tolist())
    assert other.cached_prompt == 0


def test_bf16_concurrent_completions_equal_alone_up_to_a_near_tie():
    """bf16 over whole completions: a sequence decoded among others runs its matmuls over another
    number of rows than alone (another summation order), so its logits differ by roundings; greedy tokens
    may then flip only where the two best are within that difference. Eight greedy completions of 24
    tokens, four slots: at every step where the tokens so far agree the engine's log-prob of the token
    equals the alone run's within the bound, and where a token differs, alone's two best log-probs there
    are within twice the bound (a near-tie), after which the sequences are different texts and the
    comparison stops. The bound: every rounding on the path from the embedding to the logits that batch
    size can change (per layer the four matmul outputs and two residual adds, then the norm and the head)
    differs by at most one bf16 unit, 2^-8 relative, and they add: (6 L + 2) x 2^-8 x the largest |log-prob|
    of the step's top two. Most steps are compared, so the test is not vacuous."""
    cfg = load_config("recipes/debug_llama.toml")
    model = materialize(build_model(cfg, 257, "meta"), "cpu", seed=0).eval().to(torch.bfloat16)
    layers = len(model.layers)
    rel = (6 * layers + 2) * 2 ** -8
    prompts = [list(f"def f{i}(x):\n    return x * {i} + ".encode()) for i in range(8)]
    n = 24
    engine = Engine(model, ByteTokenizer(), "cpu", max_seqs=4, max_len=64, max_queue=8, prefill_tokens=32)
    jobs = [Job(p, n, Sampling(), on_event=lambda *a: None, logprobs=2) for p in prompts]
    for j in jobs:
        engine.submit(j)
    while engine.running or engine.waiting:
        engine.step()
    compared = flipped = 0
    for p, j in zip(prompts, jobs):
        alone = generate(model, [p], n, -1, Sampling(), "cpu", keep_logits=True)[0]
        assert len(j.tokens) == n and len(j.token_logprobs) == n
        for t in range(n):
            lp = alone.logits[t].float().log_softmax(-1)
            top2 = lp.topk(2).values
            bound = rel * float(top2.abs().max())
            if j.tokens[t] != alone.tokens[t]:
                assert float(top2[0] - top2[1]) <= 2 * bound, (t, j.tokens, alone.tokens, top2, bound)
                flipped += 1
                break
            got = j.token_logprobs[t][0]
            assert abs(got - float(lp[j.tokens[t]])) <= bound, (t, got, float(lp[j.tokens[t]]), bound)
            compared += 1
    assert compared >= 0.75 * n * len(jobs), (compared, flipped)


def test_generation_and_serving_attend_without_cudnn_and_training_keeps_it(monkeypatch):
    """Every attention call of a serving step and of `generate` runs with cuDNN's SDPA kernel off
    (models.kv_cache.varying_shapes): it builds an execution plan per new shape, and a decode step's
    shapes are new at every step (an H200, torch 2.11: 4.8 ms of host time a call, 90% of a 32-request
    serving run). A training forward keeps torch's choice. Read from the flags at each call here (on
    a CPU the kernels are the CPU's; the flags are what a GPU would choose from)."""
    import torch.nn.functional as F
    seen, sdpa = [], F.scaled_dot_product_attention

    def spy(*a, **k):
        seen.append(torch.backends.cuda.cudnn_sdp_enabled())
        return sdpa(*a, **k)
    monkeypatch.setattr(F, "scaled_dot_product_attention", spy)
    cfg = load_config("recipes/debug_llama.toml")
    model = materialize(build_model(cfg, 257, "meta"), "cpu", seed=0).eval()
    engine = Engine(model, ByteTokenizer(), "cpu", max_seqs=2, max_len=64, max_queue=4)
    for prompt in (list(b"abc"), list(b"hello there")):
        engine.submit(Job(prompt, 4, Sampling(), on_event=lambda *a: None))
    while engine.running or engine.waiting:
        engine.step()
    serving, seen[:] = list(seen), []
    generate(model, [list(b"abc"), list(b"hello")], 4, -1, Sampling(), "cpu")
    generation, seen[:] = list(seen), []
    with torch.no_grad():
        model(torch.tensor([list(b"hello there")]))
    assert serving and generation and seen, (serving, generation, seen)
    assert not any(serving) and not any(generation) and all(seen), (serving, generation, seen)
    assert torch.backends.cuda.cudnn_sdp_enabled()  # (put back)
