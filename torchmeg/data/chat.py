"""Chat conversations -> token ids and the positions that are training targets.

Rendering follows transformers' `apply_chat_template` exactly (the same Jinja environment: sandboxed,
trim_blocks, lstrip_blocks, loop controls, its `tojson`, `raise_exception`, `strftime_now`, and the
tokenizer's special tokens as variables), so a conversation becomes the ids transformers would give:
`tokenizer(rendered, add_special_tokens=False)`. The template comes from a tokenizer folder
(`chat_template.jinja`, or `tokenizer_config.json`'s `chat_template`) or is one of the built-in
templates named in `BUILTIN_TEMPLATES`.

Which tokens are targets: each assistant message's content (with its <think> block where the
template keeps it; the answer after it where the template drops it), found in the rendering in
message order, and the turn terminator the template writes after it (learned from the template itself: what follows
an assistant message's content up to the next line). A template that rewrites the content so it
cannot be found gets a one-line error naming the record.
"""
from __future__ import annotations

import functools
import json
import os
from datetime import datetime

import numpy as np

from torchmeg.config.errors import ConfigError

# Built-in templates, for tokenizers that ship none (the byte tokenizer of the CPU recipes).
BUILTIN_TEMPLATES = {
    # ChatML, as Qwen2/Qwen3 render a conversation without tools or reasoning.
    "chatml": (
        "{%- for message in messages %}"
        "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
        "{%- endfor %}"
        "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"),
    # Llama-3's header/eot layout (without its date and tool preamble).
    "llama3": (
        "{{- bos_token }}"
        "{%- for message in messages %}"
        "{{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n' + message['content'] | trim"
        " + '<|eot_id|>' }}"
        "{%- endfor %}"
        "{%- if add_generation_prompt %}{{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{%- endif %}"),
}
ROLES = ("system", "user", "assistant", "tool")


class ChatDataError(ValueError):
    """A record that cannot be rendered or trained on; the message names the file and the record."""


@functools.lru_cache(maxsize=16)
def _compile(source: str):
    """The template compiled in transformers' environment (utils/chat_template_utils.py)."""
    import jinja2  # lazy: only chat data renders templates
    from jinja2.ext import loopcontrols  # lazy (as above)
    from jinja2.sandbox import ImmutableSandboxedEnvironment  # lazy (as above)

    def raise_exception(message):
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        # transformers' filter: no HTML escaping, json.dumps' options
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    def strftime_now(fmt):
        return datetime.now().strftime(fmt)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = strftime_now
    return env.from_string(source)


def _token_text(v) -> str | None:
    """A special token as tokenizer_config.json writes it: a string or an AddedToken dict."""
    if isinstance(v, dict):
        return v.get("content")
    return v if isinstance(v, str) else None


class ChatTemplate:
    """A Jinja chat template and the special-token variables it is rendered with."""

    def __init__(self, source: str, special: dict | None = None, name: str = "template"):
        self.source, self.name = source, name
        self.special = {k: v for k, v in (special or {}).items() if v is not None}
        self._template = _compile(source)
        self._terminator = None

    @classmethod
    def load(cls, spec: str) -> "ChatTemplate":
        """`spec`: a built-in name (BUILTIN_TEMPLATES), a tokenizer folder, a `tokenizer.json` (its
        folder is read), or a `.jinja` file."""
        if spec in BUILTIN_TEMPLATES:
            return cls(BUILTIN_TEMPLATES[spec], {"bos_token": "<|begin_of_text|>"}, spec)
        if spec.endswith(".jinja") and os.path.isfile(spec):
            with open(spec) as fh:
                return cls(fh.read(), {}, spec)
        folder = os.path.dirname(spec) if os.path.isfile(spec) else spec
        config_path = os.path.join(folder, "tokenizer_config.json")
        config = {}
        if os.path.isfile(config_path):
            with open(config_path) as fh:
                config = json.load(fh)
        special = {k: _token_text(config.get(k)) for k in
                   ("bos_token", "eos_token", "unk_token", "pad_token", "sep_token", "cls_token", "mask_token")}
        jinja_path = os.path.join(folder, "chat_template.jinja")
        if os.path.isfile(jinja_path):  # transformers >= 4.49 saves the template beside the config
            with open(jinja_path) as fh:
                return cls(fh.read(), special, jinja_path)
        source = config.get("chat_template")
        if isinstance(source, list):  # named templates: the default one
            source = {t.get("name"): t.get("template") for t in source}.get("default")
        if not isinstance(source, str):
            raise ChatDataError(f"{folder}: no chat template (neither chat_template.jinja nor a chat_template in "
                                f"tokenizer_config.json); set data.chat_template to one of {sorted(BUILTIN_TEMPLATES)}")
        return cls(source, special, config_path)

    def render(self, messages: list[dict], add_generation_prompt: bool = False, **kwargs) -> str:
        return self._template.render(messages=messages, add_generation_prompt=add_generation_prompt,
                                     **self.special, **kwargs)

    def terminator(self) -> str:
        """What the template writes after an assistant message's content to end the turn, up to the
        line's end ('<|im_end|>', '<|eot_id|>', an eos token...): trained as part of the answer, so the
        model learns to stop."""
        if self._terminator is None:
            probe = "TorchmegProbeAnswer42"  # no whitespace: templates trim answers
            text = self.render([{"role": "user", "content": "question"}, {"role": "assistant", "content": probe}])
            after = text[text.index(probe) + len(probe):] if probe in text else ""
            self._terminator = after.split("\n", 1)[0].rstrip()
        return self._terminator

    def target_spans(self, messages: list[dict], text: str) -> list[tuple[int, int]]:
        """[start, end) character spans of `text` (this template's rendering of `messages`) that are
        training targets: each assistant content with its terminator. Raises ChatDataError when a
        message's content is not where the template should have written it."""
        spans, cursor, end_mark = [], 0, self.terminator()
        for i, m in enumerate(messages):
            content = m["content"].strip()
            at = text.find(content, cursor) if content else cursor
            if at < 0 and "</think>" in content:  # templates that drop earlier turns' reasoning (Qwen3, R1)
                content = content.split("</think>")[-1].strip()
                at = text.find(content, cursor)
            if at < 0:
                raise ChatDataError(f"message {i} ({m['role']}): its content is not in the rendered conversation "
                                    f"(template {self.name} rewrites it); targets cannot be located")
            end = at + len(content)
            trail = m["content"][len(m["content"].rstrip()):]  # kept by templates that do not trim
            if trail and text.startswith(trail, end):
                end += len(trail)
            if m["role"] == "assistant":
                if end_mark and text.startswith(end_mark, end):
                    end += len(end_mark)
                spans.append((at, end))
            cursor = end
        return spans


def check_messages(messages, where: str) -> list[dict]:
    """The record's messages, or ChatDataError naming `where` (file:line) and what is wrong."""
    if not isinstance(messages, list) or not messages:
        raise ChatDataError(f"{where}: 'messages' must be a non-empty list of {{'role', 'content'}}")
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or "role" not in m or "content" not in m:
            raise ChatDataError(f"{where}: message {i} needs 'role' and 'content' (got {str(m)[:80]})")
        if m["role"] not in ROLES:
            raise ChatDataError(f"{where}: message {i} has role {m['role']!r}; roles are {', '.join(ROLES)}")
        if not isinstance(m["content"], str):
            raise ChatDataError(f"{where}: message {i} content must be a string")
        if m["role"] == "assistant" and not m["content"].strip():
            raise ChatDataError(f"{where}: message {i} is an empty assistant turn (nothing to train on)")
    if not any(m["role"] == "assistant" for m in messages):
        raise ChatDataError(f"{where}: no assistant message (nothing to train on)")
    return messages


def token_offsets(tokenizer, text: str) -> tuple[np.ndarray, np.ndarray]:
    """(ids, [n, 2] character offsets) of `text` as the tokenizer splits it, no special tokens added."""
    hf = getattr(tokenizer, "tok", None)
    if hf is not None:
        enc = hf.encode(text, add_special_tokens=False)
        return np.asarray(enc.ids, dtype=np.int64), np.asarray(enc.offsets, dtype=np.int64).reshape(-1, 2)
    # byte tokenizer: one id per UTF-8 byte; a character's bytes all carry its span
    ids, offsets = [], []
    for i, ch in enumerate(text):
        for b in ch.encode("utf-8"):
            ids.append(b)
            offsets.append((i, i + 1))
    return np.asarray(ids, dtype=np.int64), np.asarray(offsets, dtype=np.int64).reshape(-1, 2)


def encode_conversation(template: ChatTemplate, tokenizer, messages: list[dict],
                        train_on_prompt: bool = False, last_only: bool = False) -> tuple[np.ndarray, np.ndarray]:
    """(ids, target mask) of one conversation: ids as transformers' apply_chat_template(tokenize=True)
    gives them; mask[i] = 1 where token i is a training target (any character of it inside an
    assistant span, or only the last one's with `last_only`; every token with `train_on_prompt`)."""
    text = template.render(messages)
    ids, offsets = token_offsets(tokenizer, text)
    if train_on_prompt:
        return ids, np.ones(len(ids), dtype=np.uint8)
    mask = np.zeros(len(ids), dtype=np.uint8)
    spans = template.target_spans(messages, text)
    for a, b in spans[-1:] if last_only else spans:  # last_only: the final answer (DPO's completion)
        mask |= ((offsets[:, 0] < b) & (offsets[:, 1] > a)).astype(np.uint8)
    return ids, mask


def chat_template(cfg) -> ChatTemplate:
    """The recipe's chat template: data.chat_template, else the tokenizer folder's own."""
    d = cfg.data
    spec = d.chat_template or (d.tokenizer if d.tokenizer != "byte" else "")
    if not spec:
        raise ConfigError("data.chat_template = \"\": the byte tokenizer has no chat template of its own; name a "
                          "built-in one (chatml, llama3), a tokenizer folder or a .jinja file")
    try:
        return ChatTemplate.load(spec)
    except ChatDataError as e:
        raise ConfigError(f"data.chat_template: {e}") from None
