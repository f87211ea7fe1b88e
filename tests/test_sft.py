"""Supervised fine-tuning: chat rendering against transformers (the reference), the SFT loss against a
plain transformers forward with the same labels, every layout = one process, bad records refused.

Tokenizers and models are built here, offline: a byte-level BPE trained on stdlib text with the
special tokens the real templates use, and tiny transformers configs with random weights."""
from __future__ import annotations

import json
import os

import pytest
import torch

from conftest import FP32_PARITY, TINY, assert_close, assert_parity, byte_level_bpe, decoded_runs, read_metrics, reference_run
from launch import run_one, run_cli

# Llama-3-8B-Instruct's template, as its tokenizer_config.json ships it.
LLAMA3 = ("{% set loop_messages = messages %}{% for message in loop_messages %}{% set content = "
          "'<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n'+ message['content'] | trim + "
          "'<|eot_id|>' %}{% if loop.index0 == 0 %}{% set content = bos_token + content %}{% endif %}{{ content }}"
          "{% endfor %}{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}"
          "{% endif %}")
# Qwen3's template without its tool branches: the system turn, the last-query namespace walked in reverse,
# <think> blocks kept only after the last user query, enable_thinking.
QWEN3 = """{%- if messages[0].role == 'system' %}
    {{- '<|im_start|>system\\n' + messages[0].content + '<|im_end|>\\n' }}
{%- endif %}
{%- set ns = namespace(multi_step_tool=true, last_query_index=messages|length - 1) %}
{%- for message in messages[::-1] %}
    {%- set index = (messages|length - 1) - loop.index0 %}
    {%- if ns.multi_step_tool and message.role == "user" and message.content is string %}
        {%- set ns.multi_step_tool = false %}
        {%- set ns.last_query_index = index %}
    {%- endif %}
{%- endfor %}
{%- for message in messages %}
    {%- set content = message.content if message.content is string else '' %}
    {%- if (message.role == "user") or (message.role == "system" and not loop.first) %}
        {{- '<|im_start|>' + message.role + '\\n' + content + '<|im_end|>' + '\\n' }}
    {%- elif message.role == "assistant" %}
        {%- set reasoning_content = '' %}
        {%- if '</think>' in content %}
            {%- set reasoning_content = content.split('</think>')[0].rstrip('\\n').split('<think>')[-1].lstrip('\\n') %}
            {%- set content = content.split('</think>')[-1].lstrip('\\n') %}
        {%- endif %}
        {%- if loop.index0 > ns.last_query_index and (loop.last or reasoning_content) %}
            {{- '<|im_start|>' + message.role + '\\n<think>\\n' + reasoning_content.strip('\\n') + '\\n</think>\\n\\n' + content.lstrip('\\n') }}
        {%- else %}
            {{- '<|im_start|>' + message.role + '\\n' + content }}
        {%- endif %}
        {{- '<|im_end|>\\n' }}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\\n' }}
    {%- if enable_thinking is defined and enable_thinking is false %}
        {{- '<think>\\n\\n</think>\\n\\n' }}
    {%- endif %}
{%- endif %}"""
TEMPLATES = {
    "llama3": (LLAMA3, "<|begin_of_text|>", "<|eot_id|>"),
    "qwen3": (QWEN3, None, "<|im_end|>"),
}
SPECIAL = ["<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>",
           "<|im_start|>", "<|im_end|>", "<|endoftext|>"]

CONVERSATIONS = [
    [{"role": "system", "content": "You answer questions about Python."},
     {"role": "user", "content": "What does `json.dumps` return?"},
     {"role": "assistant", "content": "A string: the object serialized as JSON."},
     {"role": "user", "content": "And `json.loads`?"},
     {"role": "assistant", "content": "  The object a JSON document describes.  "}],
    # reasoning in an earlier turn: Qwen3's template drops it there (the answer alone is the target)
    [{"role": "user", "content": "2 + 2?"}, {"role": "assistant", "content": "<think>\nadd\n</think>\n\n4"},
     {"role": "user", "content": "times 3?"}, {"role": "assistant", "content": "12"}],
    [{"role": "user", "content": "Name a sorted container in the standard library."},
     {"role": "assistant", "content": "<think>\nheapq keeps a heap, bisect a sorted list\n</think>\n\nUse `bisect` "
                                      "on a list to keep it sorted."}],
    [{"role": "user", "content": "Say hello, ünïcode ✓"}, {"role": "assistant", "content": "Hello ✓ — ünïcode."}],
]


def _tokenizer_folder(path, kind: str) -> None:
    """A byte-level BPE (vocab 300) trained on a stdlib module's source, with the templates' special
    tokens, saved as transformers saves a fast tokenizer."""
    template, bos, eos = TEMPLATES[kind]
    os.makedirs(path, exist_ok=True)
    byte_level_bpe(os.path.join(path, "tokenizer.json"), 300, SPECIAL)
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "chat_template": template, "eos_token": eos,
              "model_max_length": 4096}
    if bos:
        config["bos_token"] = bos
    with open(os.path.join(path, "tokenizer_config.json"), "w") as fh:
        json.dump(config, fh)


def _hf_ids(folder, messages) -> list[int]:
    from transformers import AutoTokenizer
    out = AutoTokenizer.from_pretrained(str(folder)).apply_chat_template(messages, tokenize=True)
    return list(out["input_ids"] if hasattr(out, "keys") else out)


@pytest.mark.parametrize("kind", list(TEMPLATES))
def test_chat_rendering_equals_transformers_and_targets_are_the_answers(kind, tmp_path):
    from torchmeg.data.chat import ChatTemplate, encode_conversation
    from torchmeg.data.tokenizer import build_tokenizer
    _tokenizer_folder(tmp_path, kind)
    tok = build_tokenizer(str(tmp_path / "tokenizer.json"))
    template = ChatTemplate.load(str(tmp_path))
    end = TEMPLATES[kind][2]
    for messages in CONVERSATIONS:
        ids, mask = encode_conversation(template, tok, messages)
        assert ids.tolist() == _hf_ids(tmp_path, messages), messages
        # the targets, decoded: each answer (as the template renders it) and the turn's end; which
        # characters exactly is tests/test_chat_targets.py's (transformers' masks on real templates)
        spans = decoded_runs(lambda t: tok.tok.decode(t, skip_special_tokens=False), ids, mask)
        answers = [m["content"].split("</think>")[-1].strip() for m in messages if m["role"] == "assistant"]
        squeeze = lambda t: "".join(t.split())  # noqa: E731  (templates differ in trimming answers)
        assert len(spans) == len(answers) and all(squeeze(s).endswith(squeeze(a + end)) for s, a in zip(spans, answers)), \
            (spans, answers)
        # and nothing of a prompt is: the user's words never appear in a target
        for m in messages:
            if m["role"] != "assistant":
                assert all(m["content"] not in s for s in spans)
    # train_on_prompt: every token
    _, everything = encode_conversation(template, tok, CONVERSATIONS[0], train_on_prompt=True)
    assert everything.all()


def test_builtin_templates_render_like_transformers(tmp_path):
    """The built-in chatml / llama3 templates go through the same renderer transformers uses."""
    from transformers.utils.chat_template_utils import render_jinja_template
    from torchmeg.data.chat import BUILTIN_TEMPLATES, ChatTemplate
    for name, source in BUILTIN_TEMPLATES.items():
        t = ChatTemplate.load(name)
        for messages in CONVERSATIONS:
            for gen in (False, True):
                want = render_jinja_template([messages], chat_template=source, add_generation_prompt=gen,
                                             **t.special)[0][0]
                assert t.render(messages, add_generation_prompt=gen) == want


def _write_jsonl(path, conversations) -> None:
    with open(path, "w") as fh:
        for messages in conversations:
            fh.write(json.dumps({"messages": messages}) + "\n")


@pytest.mark.slow
def test_sft_step_one_loss_equals_transformers_with_the_same_labels(tmp_path):
    """Conversations packed two to a window with document masking: the step-1 loss (every window in
    the one global batch) equals transformers' cross-entropy over the same targets, each conversation
    run alone, summed and divided by the number of targets."""
    import sys
    import transformers
    from torchmeg.data.chat import ChatTemplate, encode_conversation
    from torchmeg.data.tokenizer import build_tokenizer
    from torchmeg.data.chat_data import Conversations, ChatWindows
    hf_dir = tmp_path / "hf"
    _tokenizer_folder(hf_dir, "llama3")
    config = transformers.LlamaConfig(vocab_size=300, hidden_size=64, intermediate_size=160, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                                      rms_norm_eps=1e-5, rope_theta=10000.0, tie_word_embeddings=False)
    torch.manual_seed(0)
    hf = transformers.LlamaForCausalLM(config).eval()
    with torch.no_grad():
        for p in hf.parameters():
            p.normal_(0, 0.2) if p.dim() > 1 else p.uniform_(0.5, 1.5)
    hf.save_pretrained(str(hf_dir))
    p = run_one([sys.executable, "-m", "torchmeg.convert", "from-hf", str(hf_dir), "--out", str(tmp_path / "out")],
                 dict(os.environ), 120)
    assert p.returncode == 0, p.stderr[-3000:]
    data = tmp_path / "chat.jsonl"
    _write_jsonl(data, CONVERSATIONS)

    tok = build_tokenizer(str(tmp_path / "out" / "tokenizer.json"))
    template = ChatTemplate.load(str(tmp_path / "out"))
    encoded = [encode_conversation(template, tok, m) for m in CONVERSATIONS]
    seq = 2 * max(len(ids) for ids, _ in encoded)  # room for two conversations per window
    ids = torch.cat([torch.from_numpy(i) for i, _ in encoded])
    starts = torch.tensor([0] + [len(i) for i, _ in encoded]).cumsum(0)
    conv = Conversations(ids.numpy().astype("int32"), torch.cat([torch.from_numpy(m) for _, m in encoded]).numpy(),
                         starts.numpy(), str(data))
    windows = ChatWindows(conv, seq, "train", 0.0, "truncate", 0)
    assert len(windows) < len(CONVERSATIONS)  # packing happened: some window holds two conversations

    args = ["--config", str(tmp_path / "out" / "recipe.toml"), "--training.objective=sft", f"--data.dataset={data}",
            f"--data.seq_len={seq}", "--data.document_masking=true", "--data.val_fraction=0", "--data.assistant_only_loss=true",
            f"--training.local_batch_size={len(windows)}", "--training.steps=1", "--validation.enable=false",
            "--metrics.log_freq=1", "--metrics.enable_tensorboard=false"]  # the checkpoint: the converted weights
    run_cli(args, tmp_path, name="sft")
    got = read_metrics(tmp_path, "sft")[0]["loss"]

    total, count = 0.0, 0
    with torch.no_grad():
        for a, m in encoded:
            x = torch.from_numpy(a)[None]
            logits = hf(x).logits[0, :-1].double()
            target = torch.from_numpy(a[1:]).clone()
            target[torch.from_numpy(m[1:]) == 0] = -100
            total += torch.nn.functional.cross_entropy(logits, target, ignore_index=-100, reduction="sum").item()
            count += int((target != -100).sum())
    assert count > 20
    assert_close(got, total / count, FP32_PARITY, "sft step-1 loss vs transformers")

    # generate --chat: the prompt as transformers renders a user turn with the generation prompt
    question = "What does `json.dumps` return?"
    p = run_one([sys.executable, "-m", "torchmeg.generate", "--config", str(tmp_path / "out" / "recipe.toml"),
                  "--chat", "--prompt", question, "--max-new-tokens", "8", "--json"], dict(os.environ), 120)
    assert p.returncode == 0, p.stderr[-3000:]
    row = json.loads([x for x in p.stdout.splitlines() if x.startswith("{")][0])
    from transformers import AutoTokenizer
    want = AutoTokenizer.from_pretrained(str(hf_dir)).apply_chat_template(
        [{"role": "user", "content": question}], tokenize=True, add_generation_prompt=True)
    assert row["prompt_tokens"] == list(want["input_ids"] if hasattr(want, "keys") else want)


SFT = TINY + ["--training.objective=sft", "--data.dataset=python_stdlib_chat", "--data.chat_template=chatml",
              "--data.assistant_only_loss=true", "--data.seq_len=256", "--data.document_masking=true", "--training.steps=4",
              "--training.deterministic=true", "--training.global_batch_size=8", "--checkpoint.enable=true",
              "--checkpoint.interval=2"]
P = "--parallelism."
SFT_LAYOUTS = {
    # name: (ranks, local batch, layout args); targets per window differ, so any per-rank or
    # per-microbatch mean (instead of the global batch's) moves the loss at step 1
    "fsdp2": (2, 4, [P + "data_parallel_shard_degree=2"]),
    "fsdp2_accum2": (2, 2, [P + "data_parallel_shard_degree=2"]),
    "tp2": (2, 8, [P + "tensor_parallel_degree=2", P + "data_parallel_shard_degree=1"]),
    "pp2": (2, 8, [P + "pipeline_parallel_degree=2", P + "data_parallel_shard_degree=1",
                   P + "pipeline_parallel_microbatches=4"]),
    "tp2_fsdp2": (4, 4, [P + "tensor_parallel_degree=2", P + "data_parallel_shard_degree=2"]),
    # the last stage's masked loss on vocab-sharded logits, called by the schedule (loss parallel)
    "pp2_tp2": (4, 8, [P + "pipeline_parallel_degree=2", P + "tensor_parallel_degree=2",
                       P + "data_parallel_shard_degree=1", P + "pipeline_parallel_microbatches=4"]),
    "cp2": (2, 8, [P + "context_parallel_degree=2", P + "data_parallel_shard_degree=1"]),
}


@pytest.fixture(scope="module")
def sft_reference(tmp_path_factory):
    return reference_run(tmp_path_factory, SFT + ["--training.local_batch_size=8"])


@pytest.mark.slow
@pytest.mark.parametrize("name", list(SFT_LAYOUTS))
def test_sft_layout_matches_one_process(name, tmp_path, sft_reference):
    ranks, local, layout = SFT_LAYOUTS[name]
    p = run_cli(SFT + [f"--training.local_batch_size={local}"] + layout, tmp_path, nproc=ranks)
    got = read_metrics(tmp_path)
    assert_parity(sft_reference, got)
    assert "val_loss" in got[-1]
    assert ("vocab-sharded logits (loss parallel)" in p.stdout) == ("tp2" in name), p.stdout[-2000:]


SFT_MOE = SFT + ["--model.name=moe", "--model.n_experts=4", "--model.top_k=2", "--model.moe_hidden=64"]


@pytest.mark.slow
def test_sft_moe_expert_parallel_matches_one_process(tmp_path):
    ref = tmp_path / "one"
    run_cli(SFT_MOE + ["--training.local_batch_size=8"], ref)
    run_cli(SFT_MOE + ["--training.local_batch_size=4", P + "expert_parallel_degree=2"], tmp_path, nproc=2)
    assert_parity(read_metrics(ref), read_metrics(tmp_path))


BAD = {
    "no role": ('{"messages": [{"content": "hi"}, {"role": "assistant", "content": "x"}]}', "needs 'role' and 'content'"),
    "empty answer": ('{"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": " "}]}',
                     "empty assistant turn"),
    "no answer": ('{"messages": [{"role": "user", "content": "hi"}]}', "no assistant message"),
    "bad role": ('{"messages": [{"role": "robot", "content": "hi"}, {"role": "assistant", "content": "x"}]}',
                 "has role 'robot'"),
    "not json": ('{"messages": [', "not JSON"),
    "no messages": ('{"content": "plain"}', "needs a 'messages' list"),
    "mixed prompt-completion": ('{"prompt": "2+2?", "completion": [{"role": "assistant", "content": "4"}]}',
                                "must both be strings or both lists"),
    "empty text": ('{"text": " "}', "text must be a non-empty string"),
    "empty completion": ('{"prompt": [{"role": "user", "content": "hi"}], "completion": [{"role": "assistant", '
                         '"content": " "}]}', "the completion is empty"),
}


@pytest.mark.slow
@pytest.mark.parametrize("case", list(BAD))
def test_bad_chat_record_is_refused_in_one_line_naming_file_and_line(case, tmp_path):
    line, why = BAD[case]
    good = json.dumps({"messages": CONVERSATIONS[2]})
    path = tmp_path / "chat.jsonl"
    path.write_text(good + "\n" + good + "\n" + line + "\n")
    p = run_cli(TINY + ["--training.objective=sft", f"--data.dataset={path}", "--data.chat_template=chatml",
                        "--data.seq_len=128", f"--data.cache_dir={tmp_path / 'cache'}"], tmp_path, check=False)
    assert p.returncode == 2, p.stderr[-2000:]
    errors = [x for x in p.stderr.splitlines() if x.strip()]
    assert len(errors) == 1 and f"{path}:3" in errors[0] and why in errors[0], p.stderr[-2000:]
    assert not list((tmp_path / "cache").glob("chat-*"))  # nothing tokenized from a damaged file is kept


@pytest.mark.slow
@pytest.mark.parametrize("objective, layout", [("sft", P + "data_parallel_shard_degree=2"),
                                               ("dpo", P + "tensor_parallel_degree=2")])
def test_bad_data_at_two_ranks_is_one_line_and_exit_2(objective, layout, tmp_path):
    """The data is read once per node (local rank 0); the others learn its outcome from the job's store,
    not in a barrier: every rank exits 2, one line is printed, no rank prints frames or a traceback."""
    good = {"sft": json.dumps({"messages": CONVERSATIONS[2]}), "dpo": json.dumps({"prompt": "Hi", "chosen": "a", "rejected": "b"})}
    path = tmp_path / "data.jsonl"
    path.write_text(good[objective] + "\n" + '{"messages": [' + "\n")
    p = run_cli(TINY + [f"--training.objective={objective}", f"--data.dataset={path}", "--data.chat_template=chatml",
                        "--data.seq_len=128", layout], tmp_path, nproc=2, check=False, timeout=60)
    lines = [x for x in p.stderr.splitlines() if x.strip()]
    assert p.returncode == 2 and len(lines) <= 2 and f"{path}:2" in lines[0] and "not JSON" in lines[0], p.stderr[-3000:]


@pytest.mark.slow
def test_chat_data_with_pretraining_or_a_missing_file_is_refused(tmp_path):
    p = run_cli(TINY + ["--data.dataset=python_stdlib_chat"], tmp_path, check=False)
    assert p.returncode == 2 and "training.objective = \"sft\"" in p.stderr, p.stderr[-2000:]
    p = run_cli(TINY + ["--training.objective=sft", f"--data.dataset={tmp_path / 'none.jsonl'}"], tmp_path, check=False)
    assert p.returncode == 2 and "no such file" in p.stderr, p.stderr[-2000:]
    p = run_cli(TINY + ["--training.objective=sft", "--data.dataset=python_stdlib_chat"], tmp_path, check=False)
    assert p.returncode == 2 and "data.chat_template" in p.stderr, p.stderr[-2000:]


@pytest.mark.slow
def test_chat_parquet_reads_like_jsonl_and_a_damaged_file_is_named(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq
    from torchmeg.data.chat import ChatTemplate
    from torchmeg.data.chat_data import Targets, tokenize_conversations
    from torchmeg.data.tokenizer import ByteTokenizer
    _write_jsonl(tmp_path / "c.jsonl", CONVERSATIONS)
    pq.write_table(pa.table({"messages": CONVERSATIONS}), str(tmp_path / "c.parquet"))
    t = ChatTemplate.load("chatml")
    a = tokenize_conversations([str(tmp_path / "c.jsonl")], t, ByteTokenizer(), Targets(assistant_only=True), None)
    b = tokenize_conversations([str(tmp_path / "c.parquet")], t, ByteTokenizer(), Targets(assistant_only=True), None)
    assert len(a) == len(CONVERSATIONS) and (a.ids == b.ids).all() and (a.mask == b.mask).all() \
        and (a.starts == b.starts).all()
    bad = tmp_path / "d.parquet"
    bad.write_bytes((tmp_path / "c.parquet").read_bytes()[:-30])
    p = run_cli(TINY + ["--training.objective=sft", f"--data.dataset={bad}", "--data.chat_template=chatml",
                        "--data.seq_len=128"], tmp_path, check=False)
    errors = [x for x in p.stderr.splitlines() if x.strip()]
    assert p.returncode == 2 and len(errors) == 1 and str(bad) in errors[0] and "Parquet" in errors[0], p.stderr


@pytest.mark.slow
def test_initial_load_path_starts_from_another_runs_weights_only(tmp_path):
    """checkpoint.initial_load_path: with lr 0 the first validation equals the source run's last one
    (its final weights, exactly); step, optimizer and data start anew; a restart resumes the run's own
    checkpoint, not the initial weights again; bad settings fail before launch."""
    base = TINY + ["--checkpoint.enable=true", "--checkpoint.interval=1"]
    run_cli(base + ["--training.steps=3"], tmp_path, name="src")
    src_val = [r for r in read_metrics(tmp_path, "src") if "val_loss" in r][-1]["val_loss"]
    ft = base + ["--optimizer.lr=0", f"--checkpoint.initial_load_path={tmp_path / 'src' / 'checkpoint'}"]
    p = run_cli(ft + ["--training.steps=1"], tmp_path, name="ft")
    assert "from the model weights of" in p.stdout and "step-00000003" in p.stdout, p.stdout[:2000]
    first = read_metrics(tmp_path, "ft")
    assert [r["step"] for r in first] == [1]
    assert_close(first[0]["val_loss"], src_val, FP32_PARITY, "val_loss from the loaded weights")
    p = run_cli(ft + ["--training.steps=2"], tmp_path, name="ft")  # resumes its own step 1
    assert "from the model weights of" not in p.stdout
    assert [r["step"] for r in read_metrics(tmp_path, "ft")][-1] == 2
    for extra, why in (([f"--checkpoint.initial_load_path={tmp_path / 'none'}"], "no committed checkpoint there"),
                       (["--checkpoint.enable=false", f"--checkpoint.initial_load_path={tmp_path / 'src' / 'checkpoint'}"],
                        "needs checkpoint.enable = true")):
        p = run_cli(base + extra, tmp_path, name="bad", check=False)
        assert p.returncode == 2 and why in p.stderr, p.stderr[-2000:]
