"""A converted release generates as transformers and vLLM run it: a prompt is encoded as its tokenizer is
configured (a Llama-3 tokenizer.json's post-processor adds the BOS: transformers' `tokenizer(text)`,
vLLM's completions), and decoding stops at every id the release's generation_config.json lists (an
instruct release lists its end of turn beside its end of text). Judged by transformers' `generate` with
nothing passed but greedy, on a release built here; `torchmeg.generate` and `torchmeg.serve` (the
`openai` client) both."""
from __future__ import annotations

import json
import os
import sys

import pytest
import torch

from conftest import byte_level_bpe
from launch import run_one

PROMPT = "def main(argv):"
SPECIAL = ["<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"]


def test_generation_config_ends_and_the_tokenizers_bos_are_read_from_beside_the_tokenizer(tmp_path):
    """The tokenizer's end ids: its end of text and the generation_config.json's list beside it (an
    id or a list); a malformed file or an id outside the vocabulary is one line naming the file."""
    from tokenizers import Tokenizer, processors
    from torchmeg.config.errors import ConfigError
    from torchmeg.data.tokenizer import build_tokenizer
    path = tmp_path / "tokenizer.json"
    byte_level_bpe(path, 320, SPECIAL)
    raw = Tokenizer.from_file(str(path))
    bos, end, eot = (raw.token_to_id(t) for t in ("<|begin_of_text|>", "<|end_of_text|>", "<|eot_id|>"))
    raw.post_processor = processors.TemplateProcessing(single="<|begin_of_text|> $A", special_tokens=[("<|begin_of_text|>", bos)])
    raw.save(str(path))
    tok = build_tokenizer(str(path))
    assert tok.end_ids == {end} and tok.encode_with_specials(PROMPT) == [bos] + tok.encode(PROMPT)
    beside = tmp_path / "generation_config.json"
    beside.write_text(json.dumps({"eos_token_id": [end, eot]}))
    assert build_tokenizer(str(path)).end_ids == {end, eot}  # (a file written later is read: not the cached one)
    beside.write_text(json.dumps({"eos_token_id": eot}))
    assert build_tokenizer(str(path)).end_ids == {end, eot}
    for bad, says in (("{", "not a JSON object"), (json.dumps({"eos_token_id": [end, 9999]}), "eos_token_id [")):
        beside.write_text(bad)
        with pytest.raises(ConfigError, match="generation_config.json: " + says.replace("[", r"\[")):
            build_tokenizer(str(path))


@pytest.mark.slow
def test_a_converted_release_stops_where_its_generation_config_says_in_generate_and_serve(tmp_path):
    from tokenizers import Tokenizer, processors
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from test_convert import _hf_folder
    from serving import Server
    release = tmp_path / "hf"
    hf = _hf_folder(release, "llama31")
    byte_level_bpe(release / "tokenizer.json", 320, SPECIAL)
    raw = Tokenizer.from_file(str(release / "tokenizer.json"))
    bos, end = raw.token_to_id("<|begin_of_text|>"), raw.token_to_id("<|end_of_text|>")
    raw.post_processor = processors.TemplateProcessing(single="<|begin_of_text|> $A", special_tokens=[("<|begin_of_text|>", bos)])
    raw.save(str(release / "tokenizer.json"))
    (release / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<|begin_of_text|>", "eos_token": "<|end_of_text|>"}))
    tok = AutoTokenizer.from_pretrained(str(release))
    ids = tok(PROMPT).input_ids
    assert ids[0] == bos  # (transformers adds the BOS: the post-processor is live)
    with torch.no_grad():  # the release's greedy continuation, nothing stopping it
        free = hf.generate(torch.tensor([ids]), max_new_tokens=12, do_sample=False, eos_token_id=None,
                           pad_token_id=end)  # (not 0: the BOS, which transformers would then mask as padding)
    free = free[0, len(ids):].tolist()
    # The release's second end: the first token of its continuation not seen before, 3 or more tokens
    # in (a random model never writes its end of text: this id is the one its generation stops at).
    stop_at = next(i for i in range(3, len(free)) if free[i] not in free[:i] and free[i] != end)
    (release / "generation_config.json").write_text(json.dumps({"bos_token_id": bos, "eos_token_id": [end, free[stop_at]]}))
    hf = AutoModelForCausalLM.from_pretrained(str(release)).eval()  # (reads the generation_config.json)
    with torch.no_grad():
        want = hf.generate(torch.tensor([ids]), max_new_tokens=12, do_sample=False)[0, len(ids):].tolist()
    assert want == free[:stop_at + 1]  # transformers stops there, the end included
    p = run_one([sys.executable, "-m", "torchmeg.convert", "from-hf", str(release), "--out", str(tmp_path / "out")],
                 dict(os.environ), 120)
    assert p.returncode == 0, p.stderr[-3000:]
    recipe = tmp_path / "out" / "recipe.toml"
    p = run_one([sys.executable, "-m", "torchmeg.generate", "--config", str(recipe), "--prompt", PROMPT,
                  "--max-new-tokens", "12", "--json"], dict(os.environ), 120)
    assert p.returncode == 0, p.stderr[-3000:]
    row = json.loads(next(line for line in p.stdout.splitlines() if line.startswith("{")))
    assert row["prompt_tokens"] == ids and row["finish_reason"] == "eos", row
    assert row["tokens"] == want[:-1], (row["tokens"], want)  # (the end is not part of the text's tokens)
    server = Server(None, recipe=recipe)
    try:
        model = server.client.models.list().data[0].id
        r = server.client.completions.create(model=model, prompt=PROMPT, max_tokens=12, temperature=0.0, logprobs=1)
        c = r.choices[0]
        assert c.finish_reason == "stop" and r.usage.prompt_tokens == len(ids), r
        assert r.usage.completion_tokens == len(want), r  # the stop token counted, as vLLM counts it
        assert c.text == tok.decode(want[:-1]), (c.text, tok.decode(want[:-1]))
        status, body = server.request("POST", "/tokenize", json.dumps({"prompt": PROMPT}).encode())
        assert status == 200 and json.loads(body)["tokens"] == ids, body
    finally:
        assert server.stop() == [0], server.log()
