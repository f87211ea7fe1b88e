"""A served model's sampling defaults as vLLM takes them (`--generation-config auto`, its default): the
generation_config.json beside the tokenizer sets what a request leaves out — temperature, top_p, top_k,
min_p, repetition_penalty and the chat max_tokens cap — and a request's own values win; `vllm` mode and a model without the file
keep the API's defaults; a broken file is one line before any weight is read. The routes run in this
process against an engine that records what it is given (no process launched)."""
from __future__ import annotations

import json

import pytest

from conftest import byte_level_bpe


class RecordingEngine:
    """The engine's interface to the routes: every job submitted is kept and ended at once."""

    def __init__(self):
        self.jobs = []

    def submit_all(self, jobs):
        for job in jobs:
            self.jobs.append(job)
            job.finish_reason = "length"
            job.on_event("", [], "length")

    def cancel(self, job):
        pass


def _tokenizer(tmp_path, generation_config: dict | None):
    from torchmeg.data.tokenizer import build_tokenizer
    path = tmp_path / "tokenizer.json"
    byte_level_bpe(path, 300, ["<|im_start|>", "<|im_end|>", "<|endoftext|>"])
    if generation_config is not None:
        (tmp_path / "generation_config.json").write_text(json.dumps(generation_config))
    return build_tokenizer(str(path))


def _requests(tok, defaults: dict) -> list:
    """The sampling and max_tokens of: a chat request leaving everything out, one setting all three,
    a completion leaving everything out."""
    from fastapi.testclient import TestClient
    from torchmeg.data.chat import ChatTemplate
    from torchmeg.serving.api import Served, build_app
    engine = RecordingEngine()
    client = TestClient(build_app(Served(engine, tok, ChatTemplate.load("chatml"), "", "m", 256, defaults)))
    chat = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
    for body, route in ((chat, "chat/completions"), (dict(chat, temperature=0.0, top_p=0.5, top_k=3, min_p=0.1,
                                                          repetition_penalty=1.2), "chat/completions"),
                        ({"model": "m", "prompt": "def f("}, "completions")):
        r = client.post(f"/v1/{route}", json=body)
        assert r.status_code == 200, r.text
    return [(j.sampling.temperature, j.sampling.top_p, j.sampling.top_k, j.max_tokens, j.sampling.min_p, j.repetition)
            for j in engine.jobs]


def test_generation_config_sets_what_a_request_leaves_out(tmp_path):
    from torchmeg.inference.sampling_defaults import sampling_defaults
    # a release's file (Qwen2.5-Instruct's values, a min_p and a cap added)
    tok = _tokenizer(tmp_path, {"temperature": 0.7, "top_p": 0.8, "top_k": 20, "repetition_penalty": 1.05,
                                "min_p": 0.02, "max_new_tokens": 32, "do_sample": True, "eos_token_id": [2]})
    defaults, note = sampling_defaults(tok, "auto")
    assert defaults == {"temperature": 0.7, "top_p": 0.8, "top_k": 20, "min_p": 0.02, "repetition_penalty": 1.05,
                        "max_tokens": 32}
    assert "temperature 0.7" in note and "repetition_penalty 1.05" in note, note
    # the chat default max_tokens: the rest of the context capped by max_new_tokens; completions: 16 (vLLM's)
    got = _requests(tok, defaults)
    assert got == [(0.7, 0.8, 20, 32, 0.02, 1.05), (0.0, 0.5, 3, 32, 0.1, 1.2), (0.7, 0.8, 20, 16, 0.02, 1.05)], got
    # vllm mode, and a model without the file: the API's own defaults
    assert sampling_defaults(tok, "vllm") == ({}, "")
    (tmp_path / "bare").mkdir()
    bare = _tokenizer(tmp_path / "bare", None)
    assert sampling_defaults(bare, "auto") == ({}, "")
    chat, _, completion = _requests(bare, {})
    assert chat[:3] == completion[:3] == (1.0, 1.0, 0) and chat[3] > 200 and completion[3] == 16
    assert chat[4:] == completion[4:] == (0.0, 1.0)


@pytest.mark.parametrize("content, why", [("[1, 2]", "not a JSON object"), ('{"temperature": "hot"}', "temperature"),
                                          ('{"top_p": 0}', "top_p = 0 must be in (0, 1]"),
                                          ('{"repetition_penalty": 3}', "repetition_penalty = 3 must be in (0, 2]")])
def test_a_broken_generation_config_is_one_line(tmp_path, content, why):
    from torchmeg.config.errors import ConfigError
    from torchmeg.inference.sampling_defaults import sampling_defaults
    tok = _tokenizer(tmp_path, {})
    (tmp_path / "generation_config.json").write_text(content)
    with pytest.raises(ConfigError, match="generation_config.json") as e:
        sampling_defaults(tok, "auto")
    assert why in str(e.value) and "--generation-config vllm" in str(e.value) and "\n" not in str(e.value)
