"""The serving engine's parts, each seen doing its job: the scheduler packs the prompts that start in
a step into one forward, chunks a long prompt under the token budget beside the running decodes, and
a decode forward has one row per decoding sequence (each through its block table); the output processor detokenizes incrementally (a handful of tokens per
decode, the text = the tokenizer's own decode); the KV cache is sized from a memory budget; the
metrics count what ran. Every sequence still gets the tokens `generate` gives it alone.
"""
import inspect
import json

import pytest
import torch

from conftest import byte_level_bpe
from torchmeg.config.errors import ConfigError
from torchmeg.config.schema import load_config
from torchmeg.data.tokenizer import ByteTokenizer, HFTokenizer
from torchmeg.batching.generation import Sampling, generate
from torchmeg.models import build_model, materialize
from torchmeg.models.args import model_args
from torchmeg.batching import paged
from torchmeg.batching.engine import Engine
from torchmeg.batching.metrics import Metrics
from torchmeg.serving.kv_budget import pool_size
from torchmeg.batching.output import CONTEXT, Detokenizer
from torchmeg.batching.runner import kv_bytes_per_token
from torchmeg.batching.scheduler import Job


def _model(name="llama"):
    cfg = load_config("recipes/debug_llama.toml", [f"--model.name={name}", "--model.flavor=debug"])
    return materialize(build_model(cfg, 257, "meta"), "cpu", seed=0).eval(), cfg


def _recording(engine):
    """Record every plan the runner runs and every model forward's token shape."""
    plans, shapes, forward = [], [], engine.runner.forward

    def run(plan):
        plans.append(plan)
        return forward(plan)
    engine.runner.forward = run
    engine.runner.model.register_forward_pre_hook(lambda m, args, kw: shapes.append(tuple((args or (kw["tokens_BL"],))[0].shape)),
                                                  with_kwargs=True)
    return plans, shapes


@pytest.mark.parametrize("name", ["llama", "gpt_oss"])
def test_prompts_pack_long_ones_chunk_and_decode_rows_are_the_decoding_sequences(name, monkeypatch):
    """Five short prompts start in one step: one forward of all of them packed (a row of their summed
    length), the head on each one's last token. A 40-token prompt with a budget of 16 prompt tokens a
    step is prefilled in chunks of 16, 16, 8 while the others decode in the same steps (a sequence
    being prefilled rides in no decode row). Sequences leave at different steps and their blocks go
    back: a decode forward has one row per decoding sequence, each through its own blocks. Decode steps whose sequences' lengths differ widely attend per sequence over its own keys.
    Every sequence gets `generate`'s tokens alone (greedy and seeded). gpt-oss reads the packed
    prompts' block-diagonal mask (its own attention), llama the per-prompt SDPA calls."""
    model, _ = _model(name)
    monkeypatch.setattr(paged, "PER_ROW_BYTES", 0)  # per sequence at any padding (the rule: test below)
    engine = Engine(model, ByteTokenizer(), "cpu", max_seqs=5, max_len=96, max_queue=8, prefill_tokens=16)
    plans, shapes = _recording(engine)
    prompts = [list(b"ab"), list(b"cde"), list(b"f"), list(b"ghij"), list(b"kl")]
    lengths = [3, 9, 5, 12, 7]
    sampling = [Sampling(), Sampling(temperature=0.9, seed=3), Sampling(), Sampling(top_p=0.6, temperature=1.0, seed=1),
                Sampling()]
    jobs = [Job(p, n, s, on_event=lambda *a: None) for p, n, s in zip(prompts, lengths, sampling)]
    for j in jobs:
        engine.submit(j)
    engine.step()
    assert shapes == [(1, 12)] and plans[0].prefill == [(i, 0, p) for i, p in enumerate(prompts)]
    long = Job(list(range(40, 80)), 6, Sampling(), on_event=lambda *a: None)
    while any(j.finish_reason is None for j in jobs[:1]):
        engine.step()
    engine.submit(long)
    per_row = []
    while engine.running or engine.waiting:
        engine.step()
        per_row.append(engine.cache.per_row)
        held = [b for j in engine.running.values() for b in j.blocks]
        assert len(held) == len(set(held)) == engine.pool.used()  # (no prefix shared here: each block one owner)
    assert engine.pool.used() == 0
    assert (any(per_row) and not all(per_row)) if name == "llama" else not any(per_row)  # (gpt-oss: its own attention)  # (decode over each sequence's own length where padding would waste)
    chunks = [(p.prefill, p.rows) for p in plans if any(len(c[2]) > 4 for c in p.prefill)]
    assert [len(c[0][0][2]) for c in chunks] == [16, 16, 8] and all(rows for _, rows in chunks), chunks
    assert [c[0][0][1] for c in chunks] == [0, 16, 32]
    decode_shapes = [s for s in shapes if s[1] == 1 and s[0] > 1]
    assert [len(p.rows) for p in plans if len(p.rows) > 1] == [s[0] for s in decode_shapes]
    assert all(set(p.rows).isdisjoint(c[0] for c in p.prefill) for p in plans)  # (prefilling: no decode row)
    for j, p, n, s in zip(jobs + [long], prompts + [long.prompt], lengths + [6], sampling + [Sampling()]):
        assert j.tokens == generate(model, [p], n, -1, s, "cpu")[0].tokens


def test_packed_prefill_reads_nothing_back_from_the_device():
    """Binding a packed prefill (three prompts in one row) sizes everything from the lengths the host
    has: under the mode that refuses host reads (tests/host_reads.py: .item(), .tolist(), and the ops
    whose output size a CUDA kernel must read back, repeat_interleave without output_size among them)
    it raises nothing, and the positions restart at each prompt. (It read three lengths back before.)"""
    from host_reads import HostReads
    cache = paged.PagedCache(4, "cpu")
    with HostReads(refuse=True):
        positions = cache.bind_packed([[2], [1], [3]], [3, 1, 4])
        mask = cache.mask(8, 8)
    assert positions.tolist() == [[0, 1, 2, 0, 0, 1, 2, 3]] and cache.spans == [(0, 3), (3, 4), (4, 8)]
    assert cache.write.tolist() == [32, 33, 34, 16, 48, 49, 50, 51] and mask[0, 0, 5].tolist() == [0, 0, 0, 0, 1, 1, 0, 0]


def test_decode_goes_per_sequence_where_the_padding_costs_more_than_a_call():
    """PER_ROW_BYTES (256 KiB, ~25 us of reading on this CPU, what an SDPA call costs) per sequence:
    two sequences of 1,000 and 100 positions at 1 KiB a position (the debug model) pad 900 KiB > 512
    KiB: per sequence; 300 and 200 pad 100 KiB: one call over the padded view."""
    assert paged.per_row_pays([1000, 100], 1000, 1024) and not paged.per_row_pays([300, 200], 300, 1024)
    assert paged.per_row_pays([300, 200], 300, 8 * 1024)  # (an 8B: 8 kv heads x 128 x (k, v) x fp32 = 8 KiB)


def _sentencepiece_like(path):
    """A BPE with a Metaspace pre-tokenizer and decoder (Llama 2, Mistral, T5 style: the decoder drops
    a word's leading space at the start of a text), trained here on stdlib source."""
    import textwrap
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Metaspace()
    tok.decoder = decoders.Metaspace()
    tok.train_from_iterator([inspect.getsource(textwrap), inspect.getsource(json)],
                            trainers.BpeTrainer(vocab_size=400, special_tokens=["<unk>", "</s>"]))
    tok.save(str(path))


@pytest.mark.parametrize("kind", ["byte", "byte_level_bpe", "sentencepiece_like"])
def test_incremental_detokenization_is_the_tokenizers_decode(kind, tmp_path):
    """Token by token, the text given out = the tokenizer's decode of prompt + completion beyond the
    prompt's (a sentencepiece-style decoder keeps the completion's leading space as the prompt's
    continuation; byte-level tokenizers: = decode(completion)); never an incomplete character
    (emoji and accents split across byte tokens), and each token decodes a handful of tokens, not
    the whole completion."""
    if kind == "byte":
        tok = ByteTokenizer()
    else:
        (byte_level_bpe(tmp_path / "t.json", 400, ["<|endoftext|>"]) if kind == "byte_level_bpe"
         else _sentencepiece_like(tmp_path / "t.json"))
        tok = HFTokenizer(str(tmp_path / "t.json"))
    prompt = tok.encode("The parser reads")
    completion = tok.encode(" the width of each line, then wraps it: héllo wörld 🙂 done") * 6
    seen = []
    decode = tok.decode
    tok.decode = lambda ids: seen.append(len(ids)) or decode(ids)
    d, deltas = Detokenizer(tok, prompt), []
    for t in completion:
        deltas.append(d.add(t))
    deltas.append(d.flush())
    tok.decode = decode
    want = decode(prompt + completion)[len(decode(prompt)):]
    assert "".join(deltas) == want and not any("\ufffd" in x for x in deltas)
    if kind != "sentencepiece_like":
        assert want == decode(completion)
    else:
        assert want.startswith(" the") and not decode(completion).startswith(" ")
    assert max(seen) <= CONTEXT + 8, max(seen)  # (a character of up to 4 bytes, the window behind it)


def test_kv_cache_sized_from_the_budget():
    """Bytes per position measured by a probe = layers x (k, v) x kv heads x head dim x fp32; the pool
    holds at most what --max-seqs sequences of the length fill (plus the null block), less when the
    budget is less; without --max-model-len a sequence holds what the pool allows, capped at the
    model's context, and the header's note says why; a length beyond the budget is one line naming
    the flags."""
    model, cfg = _model()
    a = model_args(cfg, 257)
    per = kv_bytes_per_token(model, "cpu")
    assert per == a.n_layers * 2 * a.kv_heads * a.head_dim * 4
    assert pool_size(32, 0, 2048, per, 2 ** 30, "x") == (2048, 1 + 32 * 128, "")  # (1 GiB holds more than that)
    got, blocks, note = pool_size(32, 0, 2048, per, 101 * 16 * per, "--kv-cache-gib 0.12")
    assert (got, blocks) == (1600, 101) and "--max-model-len 1600 of the model's 2048" in note
    assert pool_size(32, 512, 2048, per, 101 * 16 * per, "x") == (512, 101, "")  # (32 x 512 need 1,024 blocks: shared)
    with pytest.raises(ConfigError, match=r"^--max-model-len 2048: one sequence's KV takes 0\.0\d GiB, the "
                                          r"budget is 0\.0\d GiB \(--kv-cache-gib 0\.01\); lower it or raise --kv-cache-gib"):
        pool_size(32, 2048, 2048, per, 64 * 16 * per, "--kv-cache-gib 0.01")
    with pytest.raises(ConfigError, match=r"^the KV cache budget .* holds 0 blocks of 16 positions"):
        pool_size(32, 0, 2048, per, 16 * per, "x")


def test_metrics_count_what_ran():
    """Prometheus histograms: one time-to-first-token per sequence, one inter-token latency per token
    after the first, one end-to-end latency per finished sequence, finished requests by reason,
    prompt tokens = the prompts' lengths, generation tokens = the tokens generated."""
    model, _ = _model()
    engine = Engine(model, ByteTokenizer(), "cpu", max_seqs=2, max_len=64, max_queue=8, metrics=Metrics())
    jobs = [Job(list(b"xyz"[:i + 1]), 4 + i, Sampling(), on_event=lambda *a: None) for i in range(3)]
    for j in jobs:
        engine.submit(j)
    while engine.running or engine.waiting:
        engine.step()
    engine.load()
    text = engine.metrics.render().decode()
    values = {k: float(v) for k, v in (line.rsplit(" ", 1) for line in text.splitlines() if not line.startswith("#"))}
    assert values["torchmeg_time_to_first_token_seconds_count"] == 3
    assert values["torchmeg_inter_token_latency_seconds_count"] == sum(len(j.tokens) - 1 for j in jobs) == 12
    assert values["torchmeg_e2e_request_latency_seconds_count"] == 3
    assert values['torchmeg_request_success_total{finished_reason="length"}'] == 3
    assert values["torchmeg_prompt_tokens_total"] == 6 and values["torchmeg_generation_tokens_total"] == 15
    assert values["torchmeg_num_requests_running"] == 0 and values["torchmeg_requests_total"] == 3


def test_the_end_of_text_token_is_in_the_ids_and_log_probs_not_the_text():
    """What lm-eval's local-completions reads (echo, logprobs 1, max_tokens 1: token_logprobs[ctxlen:-1]
    dropped the continuation's last token when the generated one was the end of text): as vLLM, the
    token that ends a sequence is in its token ids and log-probs and in completion_tokens, and not in
    its text. Checked at the engine (the final event carries it) and in the API process's mirror of
    the job (the response's logprobs and usage)."""
    from types import SimpleNamespace

    from torchmeg.serving.api import _completion_logprobs, _usage
    from torchmeg.serving.frontend import EngineClient
    model, _ = _model()
    prompt = list(b"def f(x):\n    return")
    greedy = generate(model, [prompt], 1, -1, Sampling(), "cpu")[0].tokens[0]
    events = []
    job = Job(prompt, 1, Sampling(), on_event=lambda *e: events.append(e), eos_ids=frozenset({greedy}), logprobs=1,
              prompt_logprobs=True)
    engine = Engine(model, ByteTokenizer(), "cpu", max_seqs=1, max_len=64, max_queue=1)
    engine.submit(job)
    while engine.running or engine.waiting:
        engine.step()
    assert events[-1][1:] == ([greedy], "stop") and job.stop_token[0] == greedy
    assert len(job.token_logprobs) == 1 and job.token_logprobs[0][0] < 0
    # the API process mirrors the job from the events (serving.relay sends the token's score with it)
    client = EngineClient(None, 1, 1, 64)
    mirror = Job(prompt, 1, Sampling(), on_event=lambda *e: None, logprobs=1, prompt_logprobs=True)
    client._event(mirror, 0.0, events[-1][0], events[-1][1], "stop", job.token_logprobs[-1],
                  job.prompt_token_logprobs, 0)
    lp = _completion_logprobs(SimpleNamespace(tokenizer=ByteTokenizer()), mirror, echo=True)
    assert len(lp["token_logprobs"]) == len(prompt) + 1 and lp["token_logprobs"][-1] == job.token_logprobs[0][0]
    assert _usage(len(prompt), [mirror])["completion_tokens"] == 1
    assert events[-1][0] == ""  # (the text: the end of text is not in it)
