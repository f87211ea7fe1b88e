"""Chat conversations -> token ids and the positions that are training targets.

Rendering follows transformers' `apply_chat_template` exactly (the same Jinja environment: sandboxed,
trim_blocks, lstrip_blocks, loop controls, its `tojson`, `raise_exception`, `strftime_now`, and the
tokenizer's special tokens as variables), so a conversation becomes the ids transformers would give:
`tokenizer(rendered, add_special_tokens=False)`. The template comes from a tokenizer folder
(`chat_template.jinja`, or `tokenizer_config.json`'s `chat_template`) or is one of the built-in
templates named in `BUILTIN_TEMPLATES`.

Which tokens are targets — derived from the rendering's structure, never by searching for an
answer's text (a one-letter answer also occurs inside '<|im_start|>'):
- a template with `{% generation %}` markers (TRL's training templates; transformers derives
  `return_assistant_tokens_mask` from them): the characters rendered inside the markers, exactly as
  transformers tracks them;
- any other template, turn by turn (the prefix method): assistant turn i is what the rendering of
  messages[:i + 1] adds to the rendering of messages[:i] with the generation prompt — the answer, the
  turn's end ('<|im_end|>\n', '<|eot_id|>') and whatever the template writes around them, as TRL's
  marked templates mark it. Templates that render the prompt or earlier turns differently inside a
  conversation (R1's prompt opens <think>; Qwen3 and R1 drop earlier reasoning) are located by the
  message's content instead: rendering the conversation again with that one content replaced by
  each of two probe characters differs from the real rendering exactly over the content.
With `last_only` (DPO's completion) only the final assistant turn's tokens are targets.
"""
from __future__ import annotations

import contextvars
import functools
import json
import os
import re
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


class NoChatTemplate(ChatDataError):
    """A tokenizer folder without a chat template (a base model's): fine where none is needed."""


_TRACKED = contextvars.ContextVar("torchmeg_generation_spans", default=None)


@functools.lru_cache(maxsize=16)
def _compile(source: str):
    """The template compiled in transformers' environment (utils/chat_template_utils.py): sandboxed,
    trim_blocks, lstrip_blocks, loop controls, its `tojson`, `raise_exception`, `strftime_now`, `dict`
    and underscore-refusing `namespace`, and the `{% generation %}` tag, whose spans are recorded while
    `_TRACKED` holds (rendered blocks, spans) — the start is what was rendered before the block."""
    import jinja2  # lazy: only chat data renders templates
    from jinja2.ext import Extension, loopcontrols  # lazy (as above)
    from jinja2.sandbox import ImmutableSandboxedEnvironment  # lazy (as above)

    class Generation(Extension):
        tags = {"generation"}

        def parse(self, parser):
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return jinja2.nodes.CallBlock(self.call_method("_mark"), [], [], body).set_lineno(lineno)

        def _mark(self, caller):
            text = caller()
            tracked = _TRACKED.get()
            if tracked is not None:
                blocks, spans = tracked
                start = sum(map(len, blocks))
                spans.append((start, start + len(text)))
            return text

    def check_name(name):
        if isinstance(name, str) and name.startswith("_"):
            raise jinja2.exceptions.SecurityError(f"a namespace attribute cannot start with '_' ({name!r})")

    class Namespace(jinja2.utils.Namespace):
        def __init__(*args, **kwargs):  # jinja's signature trick: namespace(self=...) works
            self, args = args[0], args[1:]
            attrs = dict(*args, **kwargs)
            for name in attrs:
                check_name(name)
            jinja2.utils.Namespace.__init__(self, attrs)

        def __setitem__(self, name, value):
            check_name(name)
            jinja2.utils.Namespace.__setitem__(self, name, value)

    def raise_exception(message):
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        # transformers' filter: no HTML escaping, json.dumps' options
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    def strftime_now(fmt):
        return datetime.now().strftime(fmt)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[Generation, loopcontrols])
    env.filters["tojson"] = tojson
    env.globals.update(raise_exception=raise_exception, strftime_now=strftime_now, namespace=Namespace,
                       dict=lambda *a, **k: dict(*a, **k))
    return env.from_string(source)


# Two probe contents for locating a message's content in a rendering: different first and last
# characters, so at most one of them agrees with the real content at either end.
_PROBES = ("\u2460", "\u2461")


def _common_prefix(a: str, b: str) -> int:
    n = min(len(a), len(b))
    lo, hi = 0, n  # the longest equal prefix, by halving (renderings run to kilobytes)
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if a[:mid] == b[:mid]:
            lo = mid
        else:
            hi = mid - 1
    return lo


def _common_suffix(a: str, b: str) -> int:
    return _common_prefix(a[::-1], b[::-1])


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
        # whether the template marks what the model writes with {% generation %} blocks
        self.marked = re.search(r"{%-?\s*generation\s*-?%}", source) is not None

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
            raise NoChatTemplate(f"{folder}: no chat template (neither chat_template.jinja nor a chat_template in "
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
            messages = [{"role": "user", "content": "question"}, {"role": "assistant", "content": "answer"}]
            text = self.render(messages)
            after = text[self._content_bounds(messages, 1, text)[1]:]
            self._terminator = after.split("\n", 1)[0].rstrip()
        return self._terminator

    def end_of_turn(self, tokenizer) -> tuple[str, int | None]:
        """(the terminator's text, its token id when it is one token, else None): generation stops at
        that id (HF templates' '<|im_end|>', '<|eot_id|>'), or at the text as a stop string (the byte
        tokenizer writes it in several tokens)."""
        end = self.terminator()
        ids = tokenizer.encode(end) if end else []
        return end, ids[0] if len(ids) == 1 else None

    def render_marked(self, messages: list[dict]) -> tuple[str, list[tuple[int, int]]]:
        """(text, [start, end) spans of its {% generation %} blocks), as transformers tracks them."""
        blocks, spans = [], []
        token = _TRACKED.set((blocks, spans))
        try:
            for block in self._template.generate(messages=messages, add_generation_prompt=False, **self.special):
                blocks.append(block)
        finally:
            _TRACKED.reset(token)
        return "".join(blocks), spans

    def _content_bounds(self, messages: list[dict], i: int, text: str) -> tuple[int, int]:
        """[start, end) of message i's content as the template rendered it in `text` (the rendering of
        `messages`): where renderings with that content replaced by each probe differ from `text`."""
        start, suffix = len(text), len(text)
        for probe in _PROBES:
            alt = self.render(messages[:i] + [{**messages[i], "content": probe}] + messages[i + 1:])
            start = min(start, _common_prefix(text, alt))
            suffix = min(suffix, _common_suffix(text, alt))
        return start, max(start, len(text) - suffix)

    def _turn_span(self, messages: list[dict], i: int, text: str) -> tuple[int, int]:
        """Assistant turn i's [start, end) in `text`: what the template writes for the turn after the
        generation prompt — render(messages[:i + 1]) minus render(messages[:i], generation prompt) —
        where both renderings are prefixes of `text`. Otherwise (a template that renders the prompt or
        an earlier turn differently inside the conversation: R1's prompt opens <think>, Qwen3 and R1
        drop earlier reasoning) the same turn is located by its content: from the prompt (or, where
        the prompt is not in `text`, from where the content starts) to the content's end, followed by
        what the template writes after a final turn's content."""
        prompt = self.render(messages[:i], add_generation_prompt=True)
        whole = self.render(messages[:i + 1])
        prompt_ok = text.startswith(prompt)
        if prompt_ok and text.startswith(whole) and len(prompt) <= len(whole):
            return len(prompt), len(whole)
        start, end = self._content_bounds(messages, i, text)
        if prompt_ok and len(prompt) <= start:
            start = len(prompt)
        tail = whole[self._content_bounds(messages[:i + 1], i, whole)[1]:]
        return start, end + len(tail) if text.startswith(tail, end) else end

    def target_spans(self, messages: list[dict], last_only: bool = False) -> tuple[str, list[tuple[int, int]]]:
        """(the rendering of `messages`, its [start, end) character spans that are training targets):
        the {% generation %} blocks of a marked template, else each assistant turn (see the module
        docstring); with `last_only`, those of the final assistant turn only."""
        assistants = [i for i, m in enumerate(messages) if m["role"] == "assistant"]
        if self.marked:
            text, spans = self.render_marked(messages)
            if last_only:  # the blocks after the conversation before the final turn
                cut = _common_prefix(text, self.render(messages[:assistants[-1]]))
                spans = [(a, b) for a, b in spans if b > cut]
            return text, [(a, b) for a, b in spans if b > a]
        text = self.render(messages)
        return text, [self._turn_span(messages, i, text) for i in (assistants[-1:] if last_only else assistants)]


def check_turns(messages, where: str) -> list[dict]:
    """A non-empty list of {role, content: str} with known roles, or ChatDataError naming `where`."""
    if not isinstance(messages, list) or not messages:
        raise ChatDataError(f"{where}: 'messages' must be a non-empty list of {{'role', 'content'}}")
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or "role" not in m or "content" not in m:
            raise ChatDataError(f"{where}: message {i} needs 'role' and 'content' (got {str(m)[:80]})")
        if m["role"] not in ROLES:
            raise ChatDataError(f"{where}: message {i} has role {m['role']!r}; roles are {', '.join(ROLES)}")
        if not isinstance(m["content"], str):
            raise ChatDataError(f"{where}: message {i} content must be a string")
    return messages


def check_messages(messages, where: str) -> list[dict]:
    """A training record's messages (check_turns, and something to train on), or ChatDataError naming
    `where` (file:line) and what is wrong."""
    check_turns(messages, where)
    for i, m in enumerate(messages):
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


def common_prefix_length(a, b) -> int:
    """How many leading items (characters, token ids) `a` and `b` share: where a completion starts after
    its prompt (TRL's `common_prefix_length`)."""
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def encode_conversation(template: ChatTemplate, tokenizer, messages: list[dict], train_on_prompt: bool = False,
                        last_only: bool = False, completion_from: int | None = None) -> tuple[np.ndarray, np.ndarray]:
    """(ids, target mask) of one conversation: ids as transformers' apply_chat_template(tokenize=True)
    gives them; mask[i] = 1 where token i is a training target (any character of it inside an
    assistant span, or only the last one's with `last_only`; every token with `train_on_prompt`).
    `completion_from` (TRL's prompt-completion record: messages[:completion_from] its prompt): the
    targets are what follows the prompt rendered with its generation prompt, from where the two
    renderings part (TRL's completion mask, its `common_prefix_length` taken on characters)."""
    if train_on_prompt:
        ids, _ = token_offsets(tokenizer, template.render(messages))
        return ids, np.ones(len(ids), dtype=np.uint8)
    if completion_from is not None:
        text = template.render(messages)
        prompt = template.render(messages[:completion_from], add_generation_prompt=True)
        spans = [(common_prefix_length(prompt, text), len(text))]
    else:
        text, spans = template.target_spans(messages, last_only)
    ids, offsets = token_offsets(tokenizer, text)
    mask = np.zeros(len(ids), dtype=np.uint8)
    for a, b in spans:  # every token overlapping a span, as transformers' assistant mask
        mask |= ((offsets[:, 0] < b) & (offsets[:, 1] > a)).astype(np.uint8)
    return ids, mask


def chat_template(cfg, required: bool = True) -> ChatTemplate | None:
    """The recipe's chat template: data.chat_template, else the tokenizer folder's own; with
    `required = False`, None where neither names one (a base model's folder: GRPO's standard prompts
    need none, as TRL renders none for them)."""
    d = cfg.data
    spec = d.chat_template or (d.tokenizer if d.tokenizer != "byte" else "")
    if not spec:
        if not required:
            return None
        raise ConfigError("data.chat_template = \"\": the byte tokenizer has no chat template of its own; name a "
                          "built-in one (chatml, llama3), a tokenizer folder or a .jinja file")
    try:
        return ChatTemplate.load(spec)
    except ChatDataError as e:
        if isinstance(e, NoChatTemplate) and not required and not d.chat_template:
            return None
        raise ConfigError(f"data.chat_template: {e}") from None
