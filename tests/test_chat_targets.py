"""Which tokens SFT and DPO train on, judged on real templates nobody here wrote — the chat templates
TRL ships (Qwen2.5, Llama-3, Llama-3.1, Gemma-3, Qwen3, DeepSeek-R1-Distill as their releases ship
them, and TRL's training twins with `{% generation %}` markers) — against transformers:

- ids = `apply_chat_template(tokenize=True)` for every conversation and template;
- on a marked template, the target mask = transformers' `return_assistant_tokens_mask`;
- elsewhere, = the prefix derivation, computed here with transformers' own renderer: assistant turn
  i is render(messages[:i+1]) minus render(messages[:i], add_generation_prompt=True), where both are
  prefixes of the whole rendering; the turns of templates that render earlier reasoning differently
  (Qwen3, R1) are spelled out below;
- DPO's chosen and rejected rows: those TRL's DPOTrainer builds (below).

The conversations are adversarial: answers that also occur in the template's header ("a" inside
<|im_start|>, "assistant", "end"), in the question and the system prompt; one-letter, numeric,
whitespace-led and non-ASCII answers; repeated answers; reasoning blocks."""
from __future__ import annotations

import json
import os

import numpy as np
import pytest

from conftest import byte_level_bpe, decoded_runs

trl = pytest.importorskip("trl")  # the test extra; its templates are the real ones
TEMPLATE_DIR = os.path.join(os.path.dirname(trl.__file__), "chat_templates")

# name: (eos, bos) as the family's tokenizer_config.json declares them
FAMILIES = {"qwen2_5": ("<|im_end|>", None), "llama3": ("<|eot_id|>", "<|begin_of_text|>"),
            "llama3_1": ("<|eot_id|>", "<|begin_of_text|>"), "gemma3": ("<eos>", "<bos>"),
            "qwen3": ("<|im_end|>", None), "deepseek_r1_distill": ("<｜end▁of▁sentence｜>", "<｜begin▁of▁sentence｜>")}
TEMPLATES = sorted(FAMILIES) + [f + "_training" for f in sorted(FAMILIES)
                                if os.path.isfile(os.path.join(TEMPLATE_DIR, f + "_training.jinja"))]
SPECIAL = ["<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>",
           "<|im_start|>", "<|im_end|>", "<|endoftext|>", "<bos>", "<eos>", "<start_of_turn>", "<end_of_turn>",
           "<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>", "<｜User｜>", "<｜Assistant｜>"]

U, A, S = "user", "assistant", "system"
CONVERSATIONS = [
    [(U, "Pick (a) or (b)."), (A, "a")],  # 'a' first occurs inside '<|im_start|>'
    [(S, "Reply 4 or 5. The assistant says end."), (U, "2+2? 4 or 5"), (A, "4")],
    [(U, "say assistant"), (A, "assistant"), (U, "now say end"), (A, "end")],
    [(U, "lead"), (A, "\nled by a newline  ")],  # kept where the template does not trim
    [(U, "ünï ✓"), (A, "日本 ✓ ü")],
    [(U, "2 + 2?"), (A, "<think>\nadd a\n</think>\n\na"), (U, "and a?"), (A, "<think>\nthe letter a\n</think>\n\na")],
    [(U, "yes?"), (A, "yes"), (U, "yes?"), (A, "yes")],
    [(S, "Answer 12."), (U, "12?"), (A, "12"), (U, "12 again?"), (A, " 12")],
]
CONVERSATIONS = [[{"role": r, "content": c} for r, c in conv] for conv in CONVERSATIONS]


def not_prefix(name: str, k: int, messages: list[dict], last_only: bool = False) -> list[str]:
    """The turns the prefix derivation does not cover, as the template renders them inside the
    conversation (decoded targets)."""
    answers = [m["content"] for m in messages if m["role"] == "assistant"][-1 if last_only else 0:]
    if name == "deepseek_r1_distill":  # its prompt opens '<think>\n', and every turn drops its reasoning
        return [a.split("</think>")[-1] + "<｜end▁of▁sentence｜>" for a in answers]
    if name == "qwen3":  # the final answer keeps its <think> block (an empty one if it has none); earlier
        out = []          # answers (before the last user query) are rendered as their text after </think>
        for j, a in enumerate(answers):
            thought, text = a.split("</think>")[0].split("<think>")[-1] if "</think>" in a else "", a.split("</think>")[-1]
            out.append(("<think>\n" + thought.strip("\n") + "\n</think>\n\n" if j == len(answers) - 1 else "")
                       + text.lstrip("\n") + "<|im_end|>\n")
        return out
    raise AssertionError(f"{name} conversation {k}: the prefix derivation does not hold")


@pytest.fixture(scope="module")
def tokenizer_json(tmp_path_factory):
    path = tmp_path_factory.mktemp("tok") / "tokenizer.json"
    byte_level_bpe(path, 400, SPECIAL)
    return path


def _folder(tmp_path, tokenizer_json, name: str) -> str:
    """A tokenizer folder as transformers saves one, with the real template beside it."""
    eos, bos = FAMILIES[name.removesuffix("_training")]
    path = tmp_path / name
    path.mkdir()
    (path / "tokenizer.json").write_bytes(tokenizer_json.read_bytes())
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": eos, "model_max_length": 8192}
    if bos:
        config["bos_token"] = bos
    (path / "tokenizer_config.json").write_text(json.dumps(config))
    (path / "chat_template.jinja").write_text(open(os.path.join(TEMPLATE_DIR, name + ".jinja")).read())
    return str(path)


def _prefix_mask(hf, messages, last_only=False):
    """The prefix derivation with transformers' renderer and tokenizer; None where a turn's renderings
    are not prefixes of the whole."""
    render = lambda m, gen=False: hf.apply_chat_template(m, tokenize=False, add_generation_prompt=gen)  # noqa: E731
    text = render(messages)
    enc = hf(text, add_special_tokens=False, return_offsets_mapping=True)
    mask = np.zeros(len(enc["input_ids"]), dtype=np.uint8)
    turns = [i for i, m in enumerate(messages) if m["role"] == "assistant"]
    for i in turns[-1:] if last_only else turns:
        prompt, whole = render(messages[:i], True), render(messages[:i + 1])
        if not (text.startswith(prompt) and text.startswith(whole)):
            return None
        a, b = len(prompt), len(whole)
        mask |= np.array([s < b and e > a for s, e in enc["offset_mapping"]], dtype=np.uint8)
    return mask


def _spans(hf, ids, mask) -> list[str]:
    return decoded_runs(hf.decode, ids, mask)


@pytest.mark.parametrize("name", TEMPLATES)
def test_targets_equal_transformers_on_real_templates(name, tmp_path, tokenizer_json):
    from transformers import AutoTokenizer
    from torchmeg.data.chat import ChatTemplate, encode_conversation
    from torchmeg.data.tokenizer import build_tokenizer
    path = _folder(tmp_path, tokenizer_json, name)
    hf, tok, template = AutoTokenizer.from_pretrained(path), build_tokenizer(path + "/tokenizer.json"), ChatTemplate.load(path)
    assert template.marked == name.endswith("_training")
    checked = 0
    for k, messages in enumerate(CONVERSATIONS):
        out = hf.apply_chat_template(messages, tokenize=True, return_dict=True,
                                     return_assistant_tokens_mask=template.marked)
        ids, mask = encode_conversation(template, tok, messages)
        assert ids.tolist() == list(out["input_ids"]), (name, k)
        if template.marked:
            want = np.asarray(out["assistant_masks"], dtype=np.uint8)
        else:
            want = _prefix_mask(hf, messages)
        if want is None:
            assert _spans(hf, ids, mask) == not_prefix(name, k, messages), (name, k, _spans(hf, ids, mask))
        else:
            assert mask.tolist() == want.tolist(), (name, k, _spans(hf, ids, mask), _spans(hf, ids, want))
        assert mask.sum() > 0 and not mask[:3].any()  # something is trained; the header never is
        checked += 1
    assert checked == len(CONVERSATIONS)


def test_a_one_letter_answer_is_trained_where_it_stands(tmp_path):
    """The issue's case, on the built-in chatml and the byte tokenizer: the target is the answer and
    its end of turn, not the 'a' inside '<|im_start|>'."""
    from torchmeg.data.chat import ChatTemplate, encode_conversation
    from torchmeg.data.tokenizer import ByteTokenizer
    messages = CONVERSATIONS[0]
    ids, mask = encode_conversation(ChatTemplate.load("chatml"), ByteTokenizer(), messages)
    text = bytes(ids.tolist()).decode()
    targets = bytes(ids[mask > 0].tolist()).decode()
    assert targets == "a<|im_end|>\n" and text.endswith("<|im_start|>assistant\na<|im_end|>\n"), (text, targets)
    assert np.flatnonzero(mask)[0] == len(text.encode()) - len(targets.encode())


@pytest.mark.parametrize("name", sorted(FAMILIES))
def test_prompt_completion_records_train_as_trls_sft_trainer(name, tmp_path, tokenizer_json):
    """TRL's conversational prompt-completion records (`prompt` and `completion` message lists) in an SFT
    file: the ids and targets torchmeg reads are those TRL 1.16's SFTTrainer builds from the same file
    on its defaults (`completion_only_loss` for such records: every token after the prompt rendered
    with its generation prompt, from where the two renderings part), on each real template; the
    completion one answer, or an answer, a question and an answer."""
    from datasets import Dataset
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM
    from trl import SFTConfig, SFTTrainer
    from torchmeg.data.chat import ChatTemplate, encode_conversation
    from torchmeg.data.chat_data import read_records
    from torchmeg.data.tokenizer import build_tokenizer
    path = _folder(tmp_path, tokenizer_json, name)
    hf, tok, template = AutoTokenizer.from_pretrained(path), build_tokenizer(path + "/tokenizer.json"), ChatTemplate.load(path)
    records = [{"prompt": m[:-1], "completion": m[-1:]} for m in CONVERSATIONS]
    records += [{"prompt": m[:-3], "completion": m[-3:]} for m in CONVERSATIONS if len(m) >= 4 and m[-3]["role"] == A]
    file = tmp_path / "pc.jsonl"
    file.write_text("".join(json.dumps(r) + "\n" for r in records))
    ours = [encode_conversation(template, tok, messages, completion_from=k) for _, messages, k in read_records(str(file))]
    model = LlamaForCausalLM(LlamaConfig(vocab_size=len(hf), hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                         num_attention_heads=2, num_key_value_heads=1))
    trainer = SFTTrainer(model=model, processing_class=hf, train_dataset=Dataset.from_list(records),
                         args=SFTConfig(output_dir=str(tmp_path / "trl"), use_cpu=True, bf16=False, report_to="none"))
    assert trainer.args.completion_only_loss in (None, True) and not trainer.args.assistant_only_loss  # (defaults)
    theirs = trainer.train_dataset
    assert len(theirs) == len(ours) == len(records) and len(records) > len(CONVERSATIONS)
    for k, (row, (ids, mask)) in enumerate(zip(theirs, ours)):
        assert ids.tolist() == list(row["input_ids"]), (name, k)
        want = [int(label != -100) for label in row["labels"]]
        assert mask.tolist() == want, (name, k, _spans(hf, ids, mask), _spans(hf, ids, np.asarray(want)))
        assert 0 < mask.sum() < len(mask)


@pytest.mark.parametrize("name", ["qwen2_5_training", "llama3_training"])
def test_sft_targets_follow_trls_flags_on_its_defaults(name, tmp_path, tokenizer_json):
    """An SFT file of `messages` and conversational prompt-completion records read through the recipe's
    [data] keys: on TRL's defaults (assistant_only_loss false, completion_only_loss true; torchmeg's
    defaults) a conversation trains on every token and a prompt-completion record on its completion,
    as TRL 1.16's SFTTrainer on its defaults; with `data.assistant_only_loss = true` the targets are
    its assistant mask (a marked template: TRL takes the mask only from one) on both kinds of record;
    with `completion_only_loss = false` a prompt-completion record trains on every token too."""
    from datasets import Dataset
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM
    from trl import SFTConfig, SFTTrainer
    from torchmeg.config.schema import load_config
    from torchmeg.data.chat import ChatTemplate
    from torchmeg.data.chat_data import Targets, tokenize_conversations
    from torchmeg.data.tokenizer import build_tokenizer
    path = _folder(tmp_path, tokenizer_json, name)
    hf, tok, template = AutoTokenizer.from_pretrained(path), build_tokenizer(path + "/tokenizer.json"), ChatTemplate.load(path)
    records = [{"messages": m} for m in CONVERSATIONS] + [{"prompt": m[:-1], "completion": m[-1:]} for m in CONVERSATIONS]
    model = LlamaForCausalLM(LlamaConfig(vocab_size=len(hf), hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                         num_attention_heads=2, num_key_value_heads=1))
    for i, flags in enumerate(({}, {"assistant_only_loss": True}, {"completion_only_loss": False})):
        file = tmp_path / f"sft{i}.jsonl"  # TRL reads one format a dataset: each kind on its own
        rows = []
        for kind in (records[:len(CONVERSATIONS)], records[len(CONVERSATIONS):]):
            trainer = SFTTrainer(model=model, processing_class=hf, train_dataset=Dataset.from_list(kind),
                                 args=SFTConfig(output_dir=str(tmp_path / "trl"), use_cpu=True, bf16=False,
                                                report_to="none", **flags))
            rows += list(trainer.train_dataset)
        file.write_text("".join(json.dumps(r) + "\n" for r in records))
        data = load_config(None, [f"--data.{k}={str(v).lower()}" for k, v in flags.items()]).data
        ours = tokenize_conversations([str(file)], template, tok, Targets.of(data), None)
        assert len(ours) == len(rows) == 2 * len(CONVERSATIONS)
        every = 0
        for k, row in enumerate(rows):
            ids, mask = ours.get(k)
            assert ids.tolist() == list(row["input_ids"]), (name, flags, k)
            want = [int(label != -100) for label in row["labels"]]
            assert mask.tolist() == want, (name, flags, k, _spans(hf, ids, mask), _spans(hf, ids, np.asarray(want)))
            every += bool(mask.all())
        # every token: the conversations on TRL's defaults, and every record without completion_only_loss
        assert every == {0: len(CONVERSATIONS), 1: 0, 2: len(rows)}[i], (flags, every)


@pytest.mark.parametrize("name", ["llama3", "qwen2_5"])
def test_standard_sft_records_train_as_trls_sft_trainer(name, tmp_path, tokenizer_json):
    """TRL's standard SFT records, no chat template involved: prompt-completion strings (trained on the
    completion) and language modeling `text` (every token), each ended by the tokenizer's configured
    end-of-sequence token unless it ends with it: the ids and targets torchmeg reads are those TRL 1.16's
    SFTTrainer builds on its defaults; a Llama-3 style tokenizer that adds a BOS (its post-processor)
    included, as `tokenizer(text)` adds it."""
    from datasets import Dataset
    from tokenizers import Tokenizer, processors
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM
    from trl import SFTConfig, SFTTrainer
    from torchmeg.data.chat_data import read_records
    from torchmeg.data.tokenizer import build_tokenizer
    from torchmeg.data.trl_records import encode_text
    path = _folder(tmp_path, tokenizer_json, name)
    eos, bos = FAMILIES[name]
    if bos:  # the post-processor adds it, as Llama 3's tokenizer.json does
        tok = Tokenizer.from_file(path + "/tokenizer.json")
        tok.post_processor = processors.TemplateProcessing(single=f"{bos} $A", special_tokens=[(bos, tok.token_to_id(bos))])
        tok.save(path + "/tokenizer.json")
    hf, ours_tok = AutoTokenizer.from_pretrained(path), build_tokenizer(path + "/tokenizer.json")
    sets = {"prompt-completion": [{"prompt": "Q: 2 + 2?\nA:", "completion": " 4"},
                                  {"prompt": "Name a textwrap function:", "completion": " dedent" + eos},
                                  {"prompt": "ünï ✓ ", "completion": "日本"}],
            "text": [{"text": "def f(x):\n    return x"}, {"text": "already ended" + eos}]}
    model = LlamaForCausalLM(LlamaConfig(vocab_size=len(hf), hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                         num_attention_heads=2, num_key_value_heads=1))
    for kind, records in sets.items():
        file = tmp_path / f"{kind}.jsonl"
        file.write_text("".join(json.dumps(r) + "\n" for r in records))
        ours = [encode_text(ours_tok, record) for _, record, _ in read_records(str(file))]
        trainer = SFTTrainer(model=model, processing_class=hf, train_dataset=Dataset.from_list(records),
                             args=SFTConfig(output_dir=str(tmp_path / "trl"), use_cpu=True, bf16=False, report_to="none"))
        assert trainer.args.completion_only_loss in (None, True) and hf.eos_token == eos  # (TRL's defaults)
        theirs = trainer.train_dataset
        assert len(theirs) == len(ours) == len(records)
        for k, (row, (ids, mask)) in enumerate(zip(theirs, ours)):
            assert ids.tolist() == list(row["input_ids"]), (name, kind, k, hf.decode(ids), hf.decode(row["input_ids"]))
            assert ids[-1] == hf.eos_token_id and (bool(bos) and ids[0] == hf.convert_tokens_to_ids(bos)) == bool(bos), (name, kind, k)
            want = [int(label != -100) for label in row["labels"]]
            assert mask.tolist() == want, (name, kind, k, _spans(hf, ids, mask), _spans(hf, ids, np.asarray(want)))
            assert mask.all() if kind == "text" else 0 < mask.sum() < len(mask)


@pytest.mark.parametrize("name", TEMPLATES)
def test_dpo_rows_are_trls_dpo_trainer_rows(name, tmp_path, tokenizer_json):
    """Preference records in each of TRL's formats — conversational with an explicit prompt (the
    conversation before the final answer; chosen that answer, rejected another), conversational with an
    implicit prompt (whole conversations), standard strings, standard with an implicit prompt — give the
    rows TRL 1.16's DPOTrainer builds from the same records on its defaults: prompt + chosen and prompt +
    rejected, the targets after their common prefix with the prompt (the earlier of the two)."""
    import copy
    from datasets import Dataset
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM
    from trl import DPOConfig, DPOTrainer
    from torchmeg.data.chat import ChatTemplate
    from torchmeg.data.pairs import check_pair, encode_pair
    from torchmeg.data.tokenizer import build_tokenizer
    path = _folder(tmp_path, tokenizer_json, name)
    hf, tok, template = AutoTokenizer.from_pretrained(path), build_tokenizer(path + "/tokenizer.json"), ChatTemplate.load(path)
    explicit = [{"prompt": m[:-1], "chosen": m[-1:], "rejected": [{"role": A, "content": "b"}]} for m in CONVERSATIONS]
    sets = {"explicit": explicit,
            "implicit": [{"chosen": r["prompt"] + r["chosen"], "rejected": r["prompt"] + r["rejected"]} for r in explicit],
            "standard": [{"prompt": "Q: 2 + 2?\nA:", "chosen": " 4", "rejected": " 5"},
                         {"prompt": "ünï ✓", "chosen": " 日本" + hf.eos_token, "rejected": " no"}],
            "standard implicit": [{"chosen": "The sky is blue.", "rejected": "The sky is green."}]}
    model = LlamaForCausalLM(LlamaConfig(vocab_size=len(hf), hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                         num_attention_heads=2, num_key_value_heads=1))
    for kind, records in sets.items():
        ours = [encode_pair(template, tok, check_pair(r, f"{kind}[{k}]")) for k, r in enumerate(records)]
        trainer = DPOTrainer(model=model, ref_model=copy.deepcopy(model), processing_class=hf, train_dataset=Dataset.from_list(records),
                             args=DPOConfig(output_dir=str(tmp_path / "trl"), use_cpu=True, bf16=False, report_to="none"))
        theirs = trainer.train_dataset
        assert len(theirs) == len(ours) == len(records)
        for k, (row, rows) in enumerate(zip(theirs, ours)):
            for side, (ids, mask) in zip(("chosen", "rejected"), rows):
                want = list(row["prompt_ids"]) + list(row[f"{side}_ids"])
                assert ids.tolist() == want, (name, kind, k, side, hf.decode(ids), hf.decode(want))
                assert mask.tolist() == [0] * len(row["prompt_ids"]) + [1] * len(row[f"{side}_ids"]), (name, kind, k, side)
                assert 0 < mask.sum() < len(mask)
