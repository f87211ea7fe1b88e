"""The serving engine's static decode step (torchmeg.batching.static_decode): every decode step through
one compiled forward (a CUDA graph on a GPU), the batch padded to vLLM's capture sizes. Judged by the
eager engine on the same requests: the same tokens (fp32: equal; bf16: within the format's bound), one
compile over a 200-request mix of batch sizes, lengths, preemptions, sampling and penalties, and the
CPU shadow of a GPU's launches: the ATen ops a decode step dispatches.
"""
import os
import random

import pytest
import torch

from torchmeg.batching.engine import Engine
from torchmeg.batching.generation import Sampling
from torchmeg.batching.scheduler import Job
from torchmeg.batching.static_decode import capture_sizes, eligible
from torchmeg.config.schema import load_config
from torchmeg.data.tokenizer import ByteTokenizer
from torchmeg.models import build_model, materialize

def _model(dtype=torch.float32):
    cfg = load_config("recipes/debug_llama.toml", ["--model.n_layers=2"])
    return materialize(build_model(cfg, 257, "meta"), "cpu", seed=0).eval().to(dtype)


@pytest.fixture(scope="module")
def model():
    return _model()


POOL = dict(max_seqs=16, max_len=128, num_blocks=25)  # 24 usable blocks: the mix preempts


def _mix(n: int, seed: int = 0) -> list[dict]:
    """n requests: prompts of 1-100 tokens, 1-9 new tokens; greedy, sampled (seeded) and penalized."""
    rng = random.Random(seed)
    out = []
    for i in range(n):
        sampling = Sampling(temperature=0.9, top_p=0.9, seed=i) if i % 4 == 1 else Sampling()
        out.append(dict(prompt=[rng.randrange(256) for _ in range(rng.randrange(1, 101))], max_tokens=1 + i % 9,
                        sampling=sampling, presence=0.5 if i % 7 == 3 else 0.0))
    return out


def _serve(model, requests, static: bool, **kw):
    """The requests through an engine, arriving in waves of 1-24 every few steps (the running batch
    takes every size) -> (jobs, engine, decode steps run)."""
    engine = Engine(model, ByteTokenizer(), "cpu", max_queue=len(requests), static_decode=static, **kw)
    engine.reserve()
    forward, decodes = engine.runner.forward, []
    engine.runner.forward = lambda plan: (decodes.append(len(plan.rows)) if plan.rows else None, forward(plan))[1]
    jobs = [Job(list(r["prompt"]), r["max_tokens"], r["sampling"], on_event=lambda *e: None, presence=r["presence"])
            for r in requests]
    rng, queue, step = random.Random(1), list(jobs), 0
    while queue or engine.running or engine.waiting:
        if queue and step % 3 == 0:
            for _ in range(rng.randrange(1, 25)):
                if queue:
                    engine.submit(queue.pop(0))
        engine.step()
        step += 1
    return jobs, engine, decodes


@pytest.mark.slow
@pytest.mark.compile
def test_static_decode_over_a_200_request_mix_compiles_once_and_gives_the_eager_tokens(model):
    """200 requests (greedy, sampled, penalized; prompts of 1-100 tokens) arriving in waves into 16
    places over a pool too small for them all (preemptions, recomputed prompts): the static step runs
    every decode step the eager engine runs, at sizes padded to 1, 2, 4, 8, 16, compiles once (at most
    the number of sizes: dynamo's own counter agrees), and every request gets the eager engine's tokens
    and finish reason, fp32."""
    from torch._dynamo.utils import counters
    requests = _mix(200)
    eager, e_engine, e_steps = _serve(model, requests, static=False, **POOL)
    graphs_before = counters["stats"]["unique_graphs"]
    static, s_engine, s_steps = _serve(model, requests, static=True, **POOL)
    s = s_engine.runner.static
    assert s is not None and not s_engine.runner.static_failed
    assert s.sizes == capture_sizes(16) == [1, 2, 4, 8, 16]
    assert 1 <= s.compiles <= len(s.sizes), s.compiles
    assert counters["stats"]["unique_graphs"] - graphs_before == s.compiles
    # every decode step went through it, padded: several sizes, and batches that were not a size
    assert sum(s.steps.values()) == len(s_steps) == len(e_steps) > 50, (s.steps, len(e_steps))
    assert len(s.steps) >= 4 and set(s.steps) <= set(s.sizes), s.steps
    assert any(n not in s.sizes for n in s_steps)
    assert s_engine.scheduler.preemptions == e_engine.scheduler.preemptions > 0
    assert s_engine.cache.written == e_engine.cache.written
    for i, (a, b) in enumerate(zip(eager, static)):
        assert (b.tokens, b.finish_reason) == (a.tokens, a.finish_reason), (i, requests[i], a.tokens, b.tokens)


@pytest.mark.slow
@pytest.mark.compile
def test_a_static_decode_step_dispatches_a_fraction_of_the_eager_ops(model):
    """The CPU shadow of a GPU's launch-bound decode: the ATen ops one decode step of 3 sequences
    dispatches (torch's profiler), eager vs static. Eager runs ~35 ops a layer from Python; the static
    step runs inductor's fused kernels and dispatches only the matmuls, the attention and the views
    around them (a GPU replays them all as one graph)."""
    from torch.profiler import profile
    counts = {}
    for static in (False, True):
        # (the pool of the test above: its compiled step serves this engine too, no compile of its own)
        engine = Engine(model, ByteTokenizer(), "cpu", max_queue=4, static_decode=static, **POOL)
        for i in range(3):
            engine.submit(Job([5 + i, 6, 7], 8, Sampling(), on_event=lambda *e: None))
        engine.step()  # (the prompts)
        engine.step()  # (the first decode: the static step compiles)
        plan, _, _ = engine.scheduler.schedule()
        assert len(plan.rows) == 3 and not plan.prefill
        with profile() as prof, torch.no_grad():
            engine.runner.forward(plan)
        names = [e.name for e in prof.events() if e.name.startswith("aten::")]
        counts[static] = len(names)
        if static:
            assert engine.runner.static.steps[4] == 2  # (3 rows padded to 4, this step and the one before)
    layers = len(model.layers)
    assert counts[False] >= 25 * layers and counts[True] * 4 <= counts[False], counts
    # what the graph runs (dynamo's graph): q, k and v as one matmul (StackedQKV's weight), then wo,
    # w1, w3, w2 a layer and the head; on a CPU attention by the paged kernel over the pools
    # (batching.cpu_attention; no SDPA over a gathered copy, no FlexAttention). Eager's graph would hold
    # 7 a layer, the gathered step 2 SDPA calls.
    ops = engine.runner.static.graph_ops
    assert engine.runner.static.view.kernel == "paged"
    assert ops["linear"] == 5 * layers + 1, ops
    assert ops["paged_decode_attention"] == layers, ops
    assert ops["flex_attention"] == ops["scaled_dot_product_attention"] == 0, ops


@pytest.mark.slow
@pytest.mark.compile
def test_without_the_paged_kernel_the_step_runs_flex_attention_and_the_eager_tokens(monkeypatch, caplog):
    """Where the CPU kernel cannot be built (no compiler, no ninja, a build error), one warning says why
    and the static step attends by FlexAttention over the pools (inductor's C++ template): the same
    tokens as the eager engine, fp32, on a mix that decodes at several padded sizes."""
    from torchmeg.batching import cpu_attention
    monkeypatch.setattr(cpu_attention, "_state", {})
    monkeypatch.setattr(cpu_attention, "_build", lambda: (_ for _ in ()).throw(OSError("ninja: not found")))
    model = _model()  # (its own: a step compiled for the kernel is another model's)
    requests = _mix(24, seed=3)
    with caplog.at_level("WARNING", logger="torchmeg.serve"):
        static, engine, steps = _serve(model, requests, static=True, max_seqs=8, max_len=128)
    assert cpu_attention.why_not() == "OSError: ninja: not found"
    assert sum("kernel was not built (OSError: ninja: not found)" in r.getMessage() for r in caplog.records) == 1
    s = engine.runner.static
    assert s.view.kernel == "flex" and s.graph_ops["flex_attention"] == len(model.layers), s.graph_ops
    assert s.graph_ops["paged_decode_attention"] == 0 and len(s.steps) >= 2, s.steps
    eager, _, _ = _serve(model, requests, static=False, max_seqs=8, max_len=128)
    assert [(j.tokens, j.finish_reason) for j in static] == [(j.tokens, j.finish_reason) for j in eager]


@pytest.mark.slow
@pytest.mark.compile
def test_the_stacked_qkv_follows_the_weights(model):
    """The static step's q/k/v weight is a copy (batching.static_decode.StackedQKV, one per model,
    shared by its engines): a weight updated in place (an optimizer's step, load_state_dict) is stacked
    again, in place, before the next step, so the engine decodes with the new weights: its tokens are
    the eager engine's before and after, and change with the weights."""
    prompts = [[3 + i, 40, 41 + i] * (5 + 4 * i) for i in range(4)]
    saved = {k: v.clone() for k, v in model.state_dict().items()}  # (the module's model: put back at the end)

    def run(static):
        # (the pool of the tests above: their compiled step serves this engine too)
        engine = Engine(model, ByteTokenizer(), "cpu", max_queue=4, static_decode=static, **POOL)
        jobs = [Job(list(p), 12, Sampling(), on_event=lambda *e: None) for p in prompts]
        for j in jobs:
            engine.submit(j)
        while engine.running or engine.waiting:
            engine.step()
        return [j.tokens for j in jobs], engine

    before, engine = run(True)
    assert before == run(False)[0]
    stacked = engine.runner.static.qkv
    old = dict(stacked.stacks)
    try:
        with torch.no_grad():
            for layer in model.layers.values():
                layer.attention.wk.weight.mul_(-3.0)
                layer.attention.wv.weight.add_(0.05)
        after, engine = run(True)
        assert after == run(False)[0] and after != before
        # the model's one set of stacks, copied again in place (the same tensors: a CUDA graph's addresses)
        assert engine.runner.static.qkv is stacked
        for name, layer in model.layers.items():
            a = layer.attention
            assert stacked.stacks[name] is old[name]
            assert torch.equal(stacked.stacks[name], torch.cat([a.wq.weight, a.wk.weight, a.wv.weight]))
    finally:
        model.load_state_dict(saved)  # (its version counters move: the next static step stacks them again)
    assert run(True)[0] == before


@pytest.mark.slow
@pytest.mark.compile
def test_bf16_static_decode_equals_eager_up_to_the_format(tmp_path):
    """bf16: the static step fuses what eager rounds apart (the norms, RoPE, the residual adds keep
    float32 inside a fused kernel), so a log-prob may differ by the roundings on the path, at most one
    bf16 unit (2^-8 relative) for each of the 6 per layer and 2 at the end (the bound
    tests/test_serve_engine.py derives): every compared token's log-prob is within it, a greedy token
    may differ only at a near-tie (its two best within twice the bound), and most steps are compared."""
    model = _model(torch.bfloat16)
    rel = (6 * len(model.layers) + 2) * 2 ** -8
    prompts = [list(f"def f{i}(x):\n    return x * {i} + ".encode()) for i in range(8)]
    runs = {}
    for static in (False, True):
        engine = Engine(model, ByteTokenizer(), "cpu", max_seqs=8, max_len=64, max_queue=8, static_decode=static)
        jobs = [Job(p, 16, Sampling(), on_event=lambda *a: None, logprobs=2) for p in prompts]
        for j in jobs:
            engine.submit(j)
        while engine.running or engine.waiting:
            engine.step()
        runs[static] = jobs
        assert not static or sum(engine.runner.static.steps.values()) == 15
    compared = 0
    for a, b in zip(runs[False], runs[True]):
        for t in range(16):
            (lp_a, top_a), (lp_b, _) = a.token_logprobs[t], b.token_logprobs[t]
            top2 = [v for _, v in top_a]
            bound = rel * max(abs(v) for v in top2)
            if a.tokens[t] != b.tokens[t]:  # (then the texts differ: the comparison of this pair stops)
                assert top2[0] - top2[1] <= 2 * bound, (t, a.tokens, b.tokens, top2, bound)
                break
            assert abs(lp_a - lp_b) <= bound, (t, lp_a, lp_b, bound)
            compared += 1
    assert compared >= 0.75 * 16 * len(prompts), compared


def test_q_k_v_are_stacked_only_where_the_three_matmuls_are_all_they_run():
    """StackedQKV stacks a layer's q/k/v weights only for bias-free nn.Linear modules with no hook: a
    LoRA adapter (models.lora: a forward hook adds its update) would be skipped by the stacked matmul,
    so its layer keeps the three (the LoRA model's tokens stay its own); gpt-oss's attention (biases,
    its own forward) is never stacked."""
    from torchmeg.batching.static_decode import StackedQKV
    from torchmeg.models.lora import attach
    model = _model()
    assert set(StackedQKV(model).sources) == set(model.layers) == {"0", "1"}
    attach(model, ["layers.1.attention.wv"], rank=2, alpha=4.0, dropout=0.0)
    stacked = StackedQKV(model)
    assert set(stacked.sources) == {"0"} and set(stacked.current()) == {"0"}
    w = model.layers["0"].attention
    assert torch.equal(stacked.stacks["0"], torch.cat([w.wq.weight, w.wk.weight, w.wv.weight]))
    oss = materialize(build_model(load_config("recipes/gpt_oss_debug.toml", ["--model.n_layers=2"]), 257, "meta"), "cpu", seed=0)
    assert StackedQKV(oss).sources == {}


def test_hf_and_tensor_parallel_models_keep_the_eager_step():
    """Who gets the static step: torchmeg's families on one rank; an `hf` model (transformers' attention)
    and DTensor weights (tensor parallel) say why not, and --static-decode on for them is one line."""
    from types import SimpleNamespace as NS
    from torchmeg.config.errors import ConfigError
    from torchmeg.serving.cli import static_decode
    llama = _model()
    assert eligible(llama) == ""
    hf_like = torch.nn.Linear(2, 2)
    hf_like.keeps_own_cache = False
    assert "hf" in eligible(hf_like)
    args = NS(enforce_eager=False, static_decode="on")
    assert static_decode(args, llama, torch.device("cpu")) is True
    assert static_decode(NS(enforce_eager=False, static_decode="auto"), llama, torch.device("cpu")) is False
    assert static_decode(NS(enforce_eager=True, static_decode="on"), llama, torch.device("cpu")) is False
    with pytest.raises(ConfigError, match="--static-decode on: not for this model"):
        static_decode(args, hf_like, torch.device("cpu"))


def test_the_servers_static_step_keeps_its_kernels_in_this_isas_cache(tmp_path, monkeypatch):
    """The server's static step compiles into this ISA's own inductor cache (parallel.compile.setup, as
    training's compiles): torch's cache does not key on ATEN_CPU_CAPABILITY, and a 16-layer step whose
    kernels a native run had written stopped, run with ATen at AVX2, at an index past the pool. The
    eager engine leaves the cache where it was."""
    from types import SimpleNamespace as NS
    from torchmeg.parallel.compile import isa_tag
    from torchmeg.serving.cli import static_step
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path))
    cfg, llama = load_config("recipes/debug_llama.toml", []), _model()
    assert static_step(NS(enforce_eager=False, static_decode="off"), cfg, llama, torch.device("cpu")) is False
    assert os.environ["TORCHINDUCTOR_CACHE_DIR"] == str(tmp_path)
    assert static_step(NS(enforce_eager=False, static_decode="on"), cfg, llama, torch.device("cpu")) is True
    assert os.environ["TORCHINDUCTOR_CACHE_DIR"] == os.path.join(str(tmp_path), isa_tag())


@pytest.mark.slow
@pytest.mark.compile
def test_a_model_whose_step_does_not_compile_keeps_the_eager_step():
    """The MoE families route through experts dynamo does not trace as one graph (their grouped matmul
    runs under torch._dynamo.disable; a token's routing shapes the rest): their step fails to compile (fullgraph: unguarded per-layer graphs would run one layer's for
    another's), the engine decodes eagerly with one warning, every request gets the eager tokens, and
    the next engine over the model does not try again."""
    cfg = load_config("recipes/moe_debug.toml", ["--model.n_layers=2"])
    moe = materialize(build_model(cfg, 257, "meta"), "cpu", seed=0).eval()
    requests = _mix(12)
    eager, _, _ = _serve(moe, requests, static=False, max_seqs=4, max_len=128)
    static, engine, _ = _serve(moe, requests, static=True, max_seqs=4, max_len=128)
    assert engine.runner.static is None and engine.runner.static_failed  # (dynamo's first line, why)
    assert [j.tokens for j in static] == [j.tokens for j in eager]
    again = Engine(moe, ByteTokenizer(), "cpu", max_seqs=4, max_len=128, max_queue=4, static_decode=True)
    assert again.runner.static is None and "did not compile" in again.runner.static_failed
