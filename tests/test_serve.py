"""Serving (`python -m torchmeg.serve`), judged by the official `openai` client against a real
server process (tests/serving.py): its tokens are torchmeg.generate's, alone or among 32 concurrent
requests; bad input gets the API's errors and the server goes on; a client that leaves frees its slot;
TP2 serves what one process serves; lm-eval through it equals its HF backend. The server's lifecycle
(queue limit, abandoned requests, SIGTERM drain, a rank's death): tests/test_serve_lifecycle.py. The
engine in process: tests/test_serve_engine.py.
"""
import json
import os
import random
import re
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from conftest import FP32_PARITY, assert_close, assert_tensor_close
from launch import ROOT, run_one
from serving import PROMPTS, SAMPLED, Server, _complete

import openai

# ---- a real server ---------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def server(debug_run):
    s = Server(debug_run)
    yield s
    assert s.stop() == [0]


def _generate(debug_run, args) -> list[dict]:
    cmd = [sys.executable, "-m", "torchmeg.generate", "--config", "recipes/debug_llama.toml",
           f"--job.dump_folder={debug_run}", "--job.name=debug", "--data.chat_template=chatml", "--json"] + args
    p = run_one(cmd, dict(os.environ), timeout=120)
    assert p.returncode == 0, p.stderr[-3000:]
    return [json.loads(line) for line in p.stdout.splitlines() if line.startswith("{")]


def _text(tokens) -> str:  # the byte tokenizer's decode
    return bytes(t for t in tokens if t < 256).decode("utf-8", errors="replace")


@pytest.mark.slow
def test_completions_and_chat_equal_generate(debug_run, server):
    """Greedy and sampled completions, streamed and not, and greedy chat (the chatml template):
    the text torchmeg.generate gives each prompt, with its token count and finish reason."""
    n = 24
    greedy = _generate(debug_run, ["--max-new-tokens", str(n), "--ignore-eos"] + sum((["--prompt", p] for p in PROMPTS), []))
    sampled = _generate(debug_run, ["--max-new-tokens", str(n), "--ignore-eos", "--temperature", "0.9", "--top-p", "0.9",
                                    "--seed", "3"] + sum((["--prompt", p] for p in PROMPTS), []))
    chat = _generate(debug_run, ["--max-new-tokens", str(n), "--chat", "--prompt", PROMPTS[0]])
    for p, g, s in zip(PROMPTS, greedy, sampled):
        want = _text(g["tokens"])
        assert _complete(server.client, p, n) == (want, "length", n)
        assert _complete(server.client, p, n, stream=True) == (want, "length", None)
        assert _complete(server.client, p, n, **SAMPLED)[0] == _text(s["tokens"])
        assert want != _text(s["tokens"])  # sampling really sampled
    r = server.client.chat.completions.create(model="debug", messages=[{"role": "user", "content": PROMPTS[0]}],
                                              temperature=0, max_tokens=n)
    assert r.choices[0].message.content == chat[0]["text"] and r.choices[0].message.role == "assistant"
    assert r.choices[0].finish_reason == ("length" if chat[0]["finish_reason"] == "length" else "stop")
    parts = list(server.client.chat.completions.create(model="debug", messages=[{"role": "user", "content": PROMPTS[0]}],
                                                       temperature=0, max_tokens=n, stream=True))
    assert "".join(c.choices[0].delta.content or "" for c in parts) == chat[0]["text"]
    assert server.client.models.list().data[0].id == "debug"


@pytest.mark.slow
def test_32_concurrent_requests_get_the_tokens_they_get_alone(server):
    """32 requests of different prompt lengths, lengths to generate and sampling (greedy, seeded),
    first one at a time, then all at once: each gets the same text; and at once they were decoded
    together (far fewer engine steps than tokens)."""
    source = open(os.path.join(ROOT, "torchmeg", "batching", "scheduler.py")).read()
    reqs = [dict(prompt=source[37 * i: 37 * i + 5 + 11 * i], max_tokens=4 + (7 * i) % 29,
                 **(dict(temperature=0.8, seed=i, top_p=0.95) if i % 2 else {})) for i in range(32)]

    def one(r):
        return _complete(server.client, r["prompt"], r["max_tokens"], **{k: v for k, v in r.items() if k not in
                                                                          ("prompt", "max_tokens")})
    alone = [one(r) for r in reqs]
    before = server.metrics()
    with ThreadPoolExecutor(32) as pool:
        together = list(pool.map(one, reqs))
    after = server.metrics()
    assert together == alone
    assert all(finish == "length" and used == r["max_tokens"] for (_, finish, used), r in zip(together, reqs))
    tokens, steps = (after[k] - before[k] for k in ("torchmeg_generation_tokens_total", "torchmeg_steps_total"))
    assert tokens == sum(r["max_tokens"] for r in reqs) and steps < tokens / 4, (tokens, steps)


@pytest.mark.slow
def test_bad_requests_get_the_api_errors_and_the_server_goes_on(server):
    def post(body):
        status, text = server.request("POST", "/v1/completions", body if isinstance(body, bytes) else json.dumps(body).encode())
        return status, json.loads(text)
    ok = dict(model="debug", prompt="x", max_tokens=2)
    cases = [(post(b'{"model": "debug", '), 400, None),                                     # malformed JSON
             (post(dict(ok, frobnicate=1)), 400, "frobnicate"),                             # unknown field
             (post(dict(ok, max_tokens="2")), 400, "max_tokens"),                           # wrong type
             (post(dict(ok, temperature=-1)), 400, "temperature"),                          # out of range
             (post(dict(ok, max_tokens=5000)), 400, "max_tokens"),                          # beyond the context
             (post(dict(ok, logit_bias={"1": 5.0})), 400, "logit_bias"),                    # not implemented
             (post(dict(ok, model="gpt-4")), 404, "model")]
    for (got, body), status, param in cases:
        assert got == status and set(body["error"]) == {"message", "type", "param", "code"}, body
        assert body["error"]["param"] == param and body["error"]["message"], body
    assert cases[4][0][1]["error"]["code"] == "context_length_exceeded"
    with pytest.raises(openai.BadRequestError, match="maximum context length is 2048"):
        server.client.completions.create(model="debug", prompt="x" * 2000, max_tokens=100)
    with pytest.raises(openai.NotFoundError):
        server.client.chat.completions.create(model="other", messages=[{"role": "user", "content": "hi"}])
    assert _complete(server.client, "import os", 3)[1:] == ("length", 3)


@pytest.mark.slow
def test_echo_logprobs_equal_transformers_on_the_exported_model(debug_run, server, tmp_path):
    """What an evaluation harness sends to score a prompt (echo, logprobs, max_tokens 0): the prompt's
    log-probs = transformers' on the checkpoint's HF export and torchmeg.eval's loss; completions and chat report each generated
    token's log-prob with its top alternatives, sorted, the greedy token first."""
    from transformers import AutoModelForCausalLM
    hf = AutoModelForCausalLM.from_pretrained(str(debug_run / "debug" / "checkpoint" / "hf")).eval()
    ids = list(b"def fibonacci(n):\n    if n < 2:\n        return n\n    return fibonacci(n - 1) + fibonacci(n - 2)\n")
    r = server.client.completions.create(model="debug", prompt=[ids], echo=True, logprobs=2, max_tokens=0)
    lp = r.choices[0].logprobs
    assert lp.token_logprobs[0] is None and len(lp.token_logprobs) == len(ids) and r.usage.completion_tokens == 0
    with torch.no_grad():
        want = hf(torch.tensor([ids])).logits[0].log_softmax(-1)
    want = want[torch.arange(len(ids) - 1), torch.tensor(ids[1:])]
    assert_tensor_close(torch.tensor(lp.token_logprobs[1:]), want, FP32_PARITY, "echoed prompt log-probs")
    # torchmeg.eval's loss on a store of this text (one document; the eval split is not shuffled, so its
    # first window of 47 is the text's first 48 tokens) = the mean of the echoed log-probs of those
    (tmp_path / "doc.py").write_bytes(bytes(ids))
    subprocess.run([sys.executable, "tools/preprocess_data.py", "--input", str(tmp_path / "doc.py"), "--tokenizer",
                    "byte", "--output-prefix", str(tmp_path / "store")], cwd=ROOT, check=True, capture_output=True)
    p = run_one([sys.executable, "-m", "torchmeg.eval", "--config", "recipes/debug_llama.toml",
                  f"--job.dump_folder={debug_run}", "--job.name=debug", f"--data.dataset={tmp_path / 'store'}",
                  "--split", "all", "--steps", "1", "--data.seq_len=47", "--training.local_batch_size=1", "--json"],
                 dict(os.environ), 120)
    assert p.returncode == 0, p.stderr[-2000:]
    assert_close(json.loads(p.stdout.splitlines()[-1])["loss"], -sum(lp.token_logprobs[1:48]) / 47, FP32_PARITY,
                 "eval loss vs echoed log-probs")
    r = server.client.completions.create(model="debug", prompt="import os\n", logprobs=3, max_tokens=8, temperature=0,
                                         extra_body={"ignore_eos": True})
    lp = r.choices[0].logprobs
    assert "".join(lp.tokens) == r.choices[0].text and len(lp.top_logprobs) == 8
    for tok, v, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs):
        values = list(top.values())
        assert values == sorted(values, reverse=True) and top[tok] == v == values[0]
    c = server.client.chat.completions.create(model="debug", messages=[{"role": "user", "content": "hi"}],
                                              logprobs=True, top_logprobs=2, max_tokens=6, temperature=0)
    content = c.choices[0].logprobs.content
    assert "".join(x.token for x in content).startswith(c.choices[0].message.content)  # (a stop string is cut)
    assert all(x.top_logprobs[0].logprob == x.logprob and len(x.top_logprobs) == 2 for x in content)
    status, body = server.request("POST", "/tokenize", json.dumps({"prompt": "def f"}).encode())
    assert status == 200 and json.loads(body)["tokens"] == list(b"def f")
    status, body = server.request("POST", "/detokenize", json.dumps({"tokens": list(b"def f")}).encode())
    assert status == 200 and json.loads(body)["prompt"] == "def f"


@pytest.mark.slow
def test_abandoned_request_freed_unseeded_sampling_random_and_bodies_in_the_api_shape(server):
    """A non-streamed request whose client times out is cancelled within a step (its slot free within a
    second, far short of its 1,900 tokens); two unseeded temperature-1 requests differ, two seeded ones
    (seed 0 too) agree; a body that is not UTF-8 and a prompt beyond the context get the API's errors."""
    quick = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=0.5)
    before = server.metrics()["torchmeg_generation_tokens_total"]
    with pytest.raises(openai.APITimeoutError):
        quick.completions.create(model="debug", prompt="def f(x):", max_tokens=1900, temperature=0,
                                 extra_body={"ignore_eos": True})
    left = time.time()
    while server.metrics()["torchmeg_num_requests_running"]:
        assert time.time() - left < 1.0, "the abandoned request still holds its slot"
        time.sleep(0.02)
    assert server.metrics()["torchmeg_generation_tokens_total"] - before < 1900
    texts = {seed: [_complete(server.client, "import", 24, temperature=1.0, seed=seed)[0] for _ in range(2)]
             for seed in (None, 0, 5)}
    assert texts[None][0] != texts[None][1]
    assert texts[0][0] == texts[0][1] and texts[5][0] == texts[5][1] and texts[0][0] != texts[5][0]
    status, body = server.request("POST", "/v1/completions", b'{"model": "debug", "prompt": "\xff\xfe"}')
    assert status == 400 and set(json.loads(body)["error"]) == {"message", "type", "param", "code"}, body
    with pytest.raises(openai.BadRequestError, match="your prompt has"):
        server.client.chat.completions.create(model="debug", messages=[{"role": "user", "content": "x" * 2100}])


@pytest.mark.slow
def test_tp2_serves_what_one_process_serves(debug_run, server):
    """Rank 0 of two answers; both run every forward on half the heads: the same texts as one
    process, greedy and sampled, requests in flight together (more than its 4 sequences), half of them
    after one shared 53-token prefix (prefix caching: both ranks read the mapped blocks, the block
    tables in each step's plan); SIGTERM stops both ranks with 0. Rank 1 has a quarter of rank 0's KV
    budget (a GPU with less memory free): the ranks agree on the least, so a request as long as the
    header says fits on both (each rank sizing its own, rank 1's pool would run out mid-request and
    end the server)."""
    tp = Server(debug_run, ["--max-seqs", "4", "--kv-cache-gib", "0.004"], nproc=2,
                rank_env={1: {"TORCHMEG_TEST_KV_BUDGET_SCALE": "0.25"}})
    try:
        system = "You are a careful Python programmer. Answer in code.\n"
        reqs = [(p, dict(SAMPLED) if i % 2 else {}) for i, p in enumerate(PROMPTS * 2 + [system + p for p in PROMPTS * 2])]
        with ThreadPoolExecutor(len(reqs)) as pool:
            one = list(pool.map(lambda r: _complete(server.client, r[0], 20, **r[1]), reqs))
            two = list(pool.map(lambda r: _complete(tp.client, r[0], 20, **r[1]), reqs))
        assert two == one
        assert tp.metrics()["torchmeg_prefix_cache_hits_total"] > 0
        header = next(line for f in ("0.out", "0.err") for line in open(os.path.join(tp.logs, f)) if "KV pool" in line)
        length, blocks = map(int, re.search(r"up to 4 sequences of (\d+) tokens \(KV pool (\d+) blocks of 16", header).groups())
        # 2048 bytes a position per rank: rank 0's 0.004 GiB holds 131 blocks of 16 positions, rank 1's
        # quarter 32 (one the null block); each sizing its own, rank 0 would admit what rank 1 cannot hold.
        assert blocks == int(0.25 * 0.004 * 2 ** 30) // (16 * 2048) - 1 and length == 16 * blocks, header
        assert "the least of 2 ranks'" in header, header
        r = tp.client.completions.create(model="debug", prompt=[65] * (length - 8), max_tokens=8, temperature=0.0,
                                         extra_body={"ignore_eos": True})
        assert r.usage.completion_tokens == 8 and r.usage.prompt_tokens == length - 8, r
        assert tp.stop() == [0, 0]
    finally:
        tp.kill()


def _mc_task(folder) -> str:
    """A 32-question multiple-choice task built here (lm-eval's YAML, a local JSON lines file): each
    question is the start of a line of the standard library's source (indentation stripped), its
    choices the line's true next 12 characters and three scramblings of them (reversed, sorted,
    shuffled), the answer's place rotating. -> the task's include folder."""
    lines = [x.strip() for x in open(os.path.join(os.path.dirname(os.__file__), "argparse.py")).read().splitlines()
             if len(x.strip()) > 40][::23][:35]
    docs = []
    for i, line in enumerate(lines):
        true = line[24:36]
        shuffled = list(true)
        random.Random(i).shuffle(shuffled)
        choices = [true, true[::-1], "".join(sorted(true)), "".join(shuffled)]
        if len(set(choices)) == 4 and len(docs) < 32:
            order = [(i + k) % 4 for k in range(4)]
            docs.append({"question": line[:24], "choices": [choices[o] for o in order], "answer": order.index(0)})
    (folder / "mc.jsonl").write_text("\n".join(json.dumps(d) for d in docs) + "\n")
    (folder / "tiny_mc.yaml").write_text(
        "task: tiny_mc\ndataset_path: json\ndataset_kwargs:\n  data_files:\n"
        f"    test: {folder / 'mc.jsonl'}\ntest_split: test\noutput_type: multiple_choice\n"
        "doc_to_text: '{{question}}'\ndoc_to_choice: '{{choices}}'\ndoc_to_target: '{{answer}}'\n"
        "target_delimiter: ''\nmetric_list:\n  - metric: acc\n")
    return str(folder)


@pytest.mark.slow
def test_lm_eval_through_the_server_equals_its_hf_backend_on_the_export(debug_run, server, tmp_path):
    """lm-evaluation-harness 0.4.13, as teams evaluate a served model: `local-completions` against the
    server (echo + logprobs, token ids from the export's own tokenizer) and `hf` on the checkpoint's
    standalone export give every log-likelihood within 1e-4 and the same accuracy."""
    from lm_eval import simple_evaluate
    from lm_eval.tasks import TaskManager
    hf_folder = str(debug_run / "debug" / "checkpoint" / "hf")
    tasks = TaskManager(include_path=_mc_task(tmp_path))
    runs = {}
    for name, args in (("local-completions", dict(model="debug", base_url=server.url + "/v1/completions",
                                                  tokenizer_backend="huggingface", tokenizer=hf_folder)),
                       ("hf", dict(pretrained=hf_folder, device="cpu"))):
        runs[name] = simple_evaluate(model=name, model_args=args, tasks=["tiny_mc"], task_manager=tasks,
                                     log_samples=True, batch_size=1, random_seed=0, numpy_random_seed=0,
                                     torch_random_seed=0, fewshot_random_seed=0)
    served, local = (sorted(runs[n]["samples"]["tiny_mc"], key=lambda s: s["doc_id"]) for n in ("local-completions", "hf"))
    assert len(served) == len(local) == 32
    for a, b in zip(served, local):
        got, want = [r[0] for r in a["resps"]], [r[0] for r in b["resps"]]
        assert len(got) == 4 and all(abs(g[0] - w[0]) <= 1e-4 * max(1.0, abs(w[0])) for g, w in zip(got, want)), (got, want)
    accs = [runs[n]["results"]["tiny_mc"]["acc,none"] for n in ("local-completions", "hf")]
    assert accs[0] == accs[1] and accs[0] > 0.5, accs  # (the model tells code from its scramblings: not chance)
