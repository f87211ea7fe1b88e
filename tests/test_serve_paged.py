"""The paged KV cache (torchmeg.batching.blocks, batching.paged): sequences share one pool of blocks
as their tokens arrive, so the memory that held a few sequences at their longest holds as many as
their tokens fill; a pool too small for a burst preempts and recomputes, never fails; a prefix is
shared by mapping its blocks (nothing copied), and freed prefixes are evicted least recently used
first. Every request's tokens = the same request alone (greedy and seeded, fp32).
"""
import pytest
import torch

from torchmeg.batching.blocks import BLOCK, BlockPool, block_key
from torchmeg.batching.engine import Engine
from torchmeg.batching.generation import Sampling, generate
from torchmeg.batching.scheduler import Job
from torchmeg.config.schema import load_config
from torchmeg.data.tokenizer import ByteTokenizer
from torchmeg.models import build_model, materialize


@pytest.fixture(scope="module")
def model():
    cfg = load_config("recipes/debug_llama.toml")
    return materialize(build_model(cfg, 257, "meta"), "cpu", seed=0).eval()


def _run(engine, jobs, arrive=None):
    """Step until every job ended -> the most sequences that ran at once. `arrive`: {step: jobs}."""
    for j in jobs if arrive is None else ():
        engine.submit(j)
    most, steps = 0, 0
    while engine.running or engine.waiting or (arrive and steps <= max(arrive)):
        for j in (arrive or {}).get(steps, ()):
            engine.submit(j)
        engine.step()
        steps += 1
        most = max(most, len(engine.running))
        held = [b for j in engine.running.values() for b in j.blocks]
        assert len(set(held)) == engine.pool.used() and 0 not in held  # (the null block is nobody's)
    return most


def _alone(model, job):
    return generate(model, [job.prompt], job.max_tokens, -1, job.sampling, "cpu")[0].tokens


def test_the_memory_of_4_sequences_at_their_longest_holds_16_short_ones(model):
    """A pool of 64 blocks (1,024 positions: what 4 sequences of 256 reserved in a cache of slots) and
    16 requests of 10-20 prompt tokens and 20 generated: all 16 run at once (each holds the 2 or 3
    blocks its 29-39 positions fill, 40 in all), and each gets its tokens alone."""
    g = torch.Generator().manual_seed(1)
    engine = Engine(model, ByteTokenizer(), "cpu", max_seqs=16, max_len=256, max_queue=16, num_blocks=65)
    jobs = [Job(torch.randint(0, 256, (10 + i % 11,), generator=g).tolist(), 20,
                Sampling(temperature=0.8, seed=i) if i % 2 else Sampling(), on_event=lambda *e: None) for i in range(16)]
    assert _run(engine, jobs) == 16 and engine.scheduler.preemptions == 0
    for j in jobs:
        assert j.finish_reason == "length" and j.tokens == _alone(model, j)
    assert engine.pool.used() == 0


def test_a_pool_too_small_for_the_burst_preempts_and_every_request_ends_with_its_tokens_alone(model):
    """12 usable blocks (192 positions), 8 requests whose prompt and 40 tokens fill 4 blocks each (32
    in all): admitted while blocks are free, then as they grow the newest are preempted (blocks back,
    tokens kept), recomputed later (their prompt and what they had generated, prefilled), and every
    request ends with its tokens alone, greedy and seeded, an echo request's prompt scored once."""
    g = torch.Generator().manual_seed(2)
    engine = Engine(model, ByteTokenizer(), "cpu", max_seqs=8, max_len=64, max_queue=8, prefill_tokens=64,
                    num_blocks=13, prefix_caching=False)
    jobs = [Job(torch.randint(0, 256, (14 + i,), generator=g).tolist(), 40,
                Sampling(temperature=1.0, top_p=0.9, seed=i) if i % 2 else Sampling(), on_event=lambda *e: None,
                prompt_logprobs=i == 3, logprobs=0 if i == 3 else -1) for i in range(8)]
    most = _run(engine, jobs)
    assert engine.scheduler.preemptions >= 4 and most >= 3, (engine.scheduler.preemptions, most)
    assert any(j.recompute for j in jobs)  # (preempted after generating: its tokens were prefilled again)
    for j in jobs:
        assert j.finish_reason == "length" and j.tokens == _alone(model, j), jobs.index(j)
    assert len(jobs[3].prompt_token_logprobs) == len(jobs[3].prompt) - 1
    assert engine.pool.used() == 0


def test_a_shared_prefix_is_mapped_not_copied_and_eviction_keeps_results_exact(model):
    """A 70-token system prompt, then requests after it: each maps the first one's 4 full blocks (the
    same block ids, reference-counted: nothing copied; the pool's writes = the positions computed,
    the mapped ones not among them). Then in a pool too small to keep every finished prefix, other
    prompts evict the system prompt's blocks (least recently used first): a request after it
    computes it again, and every request still gets its tokens alone."""
    g = torch.Generator().manual_seed(3)
    system = torch.randint(0, 256, (70,), generator=g).tolist()
    ask = lambda prompt, i: Job(prompt, 8, Sampling(temperature=0.9, seed=i) if i % 2 else Sampling(),  # noqa: E731
                                on_event=lambda *e: None)
    engine = Engine(model, ByteTokenizer(), "cpu", max_seqs=4, max_len=96, max_queue=8, num_blocks=1 + 4 * 6)
    first = ask(system + [1, 2], 0)
    rest = [ask(system + torch.randint(0, 256, (3 + i,), generator=g).tolist(), i) for i in range(1, 4)]
    tables, shared_by_all = {}, False

    def hold():
        for j in engine.running.values():
            tables.setdefault(id(j), list(j.blocks[:4]))
    engine.submit(first)
    engine.step()
    hold()
    for j in rest:
        engine.submit(j)
    while engine.running or engine.waiting:
        engine.step()
        hold()
        if any(engine.pool.ref.get(b, 0) == 4 for b in tables[id(first)]):
            shared_by_all = True
    assert shared_by_all and [j.cached_prompt for j in rest] == [64] * 3
    assert all(tables[id(j)] == tables[id(first)] for j in rest)
    computed = sum(len(j.prompt) - j.cached_prompt + len(j.tokens) - 1 for j in [first] + rest)
    assert engine.cache.written == computed == sum(len(j.prompt) + 7 for j in [first] + rest) - 3 * 64
    for j in [first] + rest:
        assert j.tokens == _alone(model, j)
    # eviction: 24 usable blocks; 4 unrelated prompts of 90 tokens + 5 (6 blocks each) take them all
    others = [ask(torch.randint(0, 256, (90,), generator=g).tolist(), 10 + i) for i in range(4)]
    for j in others:
        j.max_tokens = 5
    _run(engine, others)
    assert engine.pool.evicted >= 4 and not engine.pool.match(system, 64)
    again = ask(system + [7], 5)
    _run(engine, [again])
    assert again.cached_prompt == 0 and again.tokens == _alone(model, again)
    assert all(j.tokens == _alone(model, j) for j in others)


def test_blocks_are_keyed_by_their_whole_prefix_and_freed_least_recently_used_first():
    """A key names the block's tokens and every token before it (the same 16 tokens after another
    prefix: another key); a block stays cached after its sequence ends, and is taken last among
    free blocks in the order they were given back; blocks without a key go first."""
    pool = BlockPool(6)
    a, b = list(range(32)), list(range(100, 116)) + list(range(16, 32))
    assert block_key(block_key(b"", a[:16]), a[16:]) != block_key(block_key(b"", b[:16]), b[16:])
    ta, tb = [], []
    assert pool.grow(ta, 33) and len(ta) == 3 and pool.free_count() == 2
    pool.register(ta, keys := [], a + [5], 33)
    assert len(keys) == 2 and pool.match(a + [5], 32) == ta[:2] and pool.match(b, 32) == []
    pool.release(ta)  # the unkeyed third block to the front, the keyed two behind it, tail first
    assert list(pool.free) == [3, 2, 1] and pool.match(a + [5], 32) == [1, 2]
    assert pool.grow(tb, 48) and tb == [4, 5, 3]  # never-used blocks first, then the unkeyed one: no eviction
    assert pool.evicted == 0 and pool.match(a, 32) == [1, 2]
    tc = []
    pool.share(tc, pool.match(a, 32))  # mapped again: out of the free queue, counted
    assert tc == [1, 2] and pool.ref[1] == 1 and not pool.grow(tc, 48)  # (nothing free: the pool is full)
    pool.release(tb)
    assert pool.grow([], 16) and pool.evicted == 0  # (an unkeyed block was free)
    assert BLOCK == 16


HF_FAMILIES = {  # tiny configs built offline; (what each adds to the attention transformers hands over)
    "llama": ("LlamaConfig", {}),                                        # GQA, RoPE
    "qwen3": ("Qwen3Config", {}),                                        # q / k norms
    "mistral": ("MistralConfig", {"sliding_window": 8}),                 # a sliding window, every layer
    "gemma3": ("Gemma3TextConfig", {"sliding_window": 8, "query_pre_attn_scalar": 24,   # sliding and full layers,
                                    "layer_types": ["sliding_attention", "full_attention"]}),  # its own scaling
    "deepseek_v3": ("DeepseekV3Config", {"kv_lora_rank": 16, "q_lora_rank": 32, "qk_rope_head_dim": 8,  # MLA: keys
                                         "qk_nope_head_dim": 8, "v_head_dim": 16, "head_dim": 8,          # and values
                                         "n_routed_experts": 4, "num_experts_per_tok": 2, "n_group": 1,   # of two widths
                                         "topk_group": 1, "moe_intermediate_size": 32, "first_k_dense_replace": 2}),
    "gemma2": ("Gemma2Config", {"sliding_window": 8}),                   # soft-capping: its own cache, one a forward
}


@pytest.mark.parametrize("fam", list(HF_FAMILIES))
def test_hf_models_run_batched_over_the_pool_as_transformers_attends(fam):
    """`hf` models (transformers' own modules) in the engine: their attention is torchmeg's over the
    paged pool (models.hf_paged: transformers' AttentionInterface), every sequence of a step in one
    forward, prefixes shared by block. Each request's tokens = `generate`'s alone, where transformers
    attends over its own DynamicCache: the judge, at windows shorter than the prompts and a scaling
    of the model's own. Gemma 2 (logit soft-capping, which the pool's attention does not compute)
    keeps transformers' cache, one sequence a forward, the same tokens."""
    import transformers
    from torchmeg.models.hf_causal import HFCausalLM, args_from_config
    cls, extra = HF_FAMILIES[fam]
    tiny = dict(vocab_size=320, hidden_size=64, intermediate_size=192, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, head_dim=16, max_position_embeddings=256)
    args = args_from_config(getattr(transformers, cls)(**dict(tiny, **extra)))
    args.attn_implementation = "eager" if fam == "gemma2" else "sdpa"  # (Gemma 2: eager only, in transformers)
    with torch.device("meta"):
        model = HFCausalLM(args)
    model = materialize(model, "cpu", seed=0).eval()
    g = torch.Generator().manual_seed(4)
    system = torch.randint(0, 300, (36,), generator=g).tolist()
    jobs = [Job(system + torch.randint(0, 300, (3 + 5 * i,), generator=g).tolist(), 10,
                Sampling(temperature=0.9, seed=i) if i % 2 else Sampling(), on_event=lambda *e: None) for i in range(4)]
    engine = Engine(model, ByteTokenizer(), "cpu", max_seqs=4, max_len=96, max_queue=8)
    forwards = []
    model.register_forward_pre_hook(lambda m, args, kw: forwards.append(tuple((args or (kw["tokens"],))[0].shape)),
                                    with_kwargs=True)
    _run(engine, jobs)
    batched = fam != "gemma2"
    assert engine.own_cache != batched
    if batched:
        assert set(engine.cache.layers) == {"hf.0", "hf.1"} and [j.cached_prompt for j in jobs] == [0, 32, 32, 32]
        assert (4, 1) in forwards  # (one decode forward for the four)
    else:
        assert max(f[0] for f in forwards) == 1
    for j in jobs:
        assert j.tokens == _alone(model, j), (fam, jobs.index(j))


def test_a_decode_step_makes_two_tensors_from_host_data_and_reads_back_once(model):
    """The CPU shadow of a decode step's host work on a GPU: the step's tokens, starts and block
    tables in one tensor made from host data, the sampling's settings in one (batching.sampler), and
    one read back (the sampled tokens); the rows of a step that only decodes are a slice of the
    logits, no index uploaded. (Before: tables and starts, tokens, the rows' index and sampling's:
    four.)"""
    from host_reads import HostReads
    from test_sampling_device import _HostTensors
    engine = Engine(model, ByteTokenizer(), "cpu", max_seqs=4, max_len=64, max_queue=4)
    jobs = [Job([5 + i, 6, 7], 6, Sampling(temperature=0.9, seed=i) if i % 2 else Sampling(), on_event=lambda *e: None)
            for i in range(4)]
    for j in jobs:
        engine.submit(j)
    engine.step()  # (the prompts, packed)
    for _ in range(3):
        with _HostTensors() as made, HostReads(refuse=False) as reads:
            engine.step()
        assert (made.uploads, reads.n) == (2, 1), (made.uploads, reads.n)
    assert all(len(j.tokens) == 4 for j in jobs)
    # every row greedy with nothing to apply (no penalty, no log-probs): the argmax alone, so one tensor
    # from host data (the step's own), one read; the tokens those of the full sampling path
    greedy = [Job([9 + i, 6, 7], 6, Sampling(), on_event=lambda *e: None) for i in range(4)]
    full = [Job([9 + i, 6, 7], 6, Sampling(), on_event=lambda *e: None, presence=1e-30) for i in range(4)]
    for batch in (greedy, full):
        engine = Engine(model, ByteTokenizer(), "cpu", max_seqs=4, max_len=64, max_queue=4)
        for j in batch:
            engine.submit(j)
        engine.step()
        with _HostTensors() as made, HostReads(refuse=False) as reads:
            engine.step()
        assert (made.uploads, reads.n) == ((1, 1) if batch is greedy else (2, 1)), (made.uploads, reads.n)
        while engine.running or engine.waiting:
            engine.step()
    assert [j.tokens for j in greedy] == [j.tokens for j in full]
