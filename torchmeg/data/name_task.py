"""The built-in verifiable task for GRPO on a CPU (`data.dataset = "python_stdlib_names"`): asked how
to call a standard-library function, answer with its call signature, checked against the
interpreter's own `inspect.signature` — data on the machine, no download, no judge model.

The prompt is the conversation python_stdlib_chat trains the SFT debug model on: "What does
`json.loads` do?", the first sentence of its docstring as the assistant's answer, then "How do I call
it?" (SFT shows the answer, "`json.loads(s, *, cls=None, ...)`", for a third of its conversations).
The rewards: `signature_reward`, the similarity of the answer to the true "`name(signature)`"
(difflib's ratio: 2 x matching characters / both lengths), `format_reward` 1 for an answer that is
one backticked call and nothing else, `params_reward` the F1 of its parameter names.

What the 3M-parameter SFT debug model learns from signature + format (recipes/grpo_debug.toml, 200
steps): the format, which SFT made likely enough to be sampled from the start (a share 0.03 -> 0.97),
and a short call ending its turn instead of 50-64 tokens of rambling (similarity 0.22 -> 0.31). It
does not learn the name itself: its answers converge to one short call for every question (see the
run's completions.jsonl). The similarity alone, or with params_reward, drives it to character soup
(runs of the letters names are made of), and so did a class-or-function question with partial credit
for the first letter (it settles on "`f" for everything): a model this small, after 100 SFT steps,
samples no correct name to reinforce.

Reward functions have TRL's signature: (prompts, completions, completion_ids, **columns) -> a float
per completion; a conversational completion is [{"role": "assistant", "content": text}].
"""
from __future__ import annotations

import difflib
import importlib
import inspect
import re

from torchmeg.data.chat_data import stdlib_conversations

_ASKED = re.compile(r"What does `([\w.]+)` do\?")
_CALL = re.compile(r"`[\w.]+\([^`]*\)`")


def _first_sentence(text: str, limit: int = 120) -> str:
    end = text.find(". ")
    text = text if end < 0 else text[:end + 1]
    return text if len(text) <= limit else text[:limit].rsplit(" ", 1)[0] + " ..."


def name_prompts() -> list[dict]:
    """[{"messages": [what does X do, its docstring's first sentence, how do I call it], "name": X,
    "signature": "`X(...)`", "params": [its parameter names]}] for every python_stdlib_chat function
    with a signature."""
    out, seen = [], set()
    for conversation in stdlib_conversations():
        turns = [m for m in conversation if m["role"] != "system"]
        asked = _ASKED.fullmatch(turns[0]["content"])
        if asked is None or asked.group(1) in seen:
            continue
        full = asked.group(1)
        module, _, name = full.rpartition(".")
        try:
            sig = inspect.signature(getattr(importlib.import_module(module), name))
        except (ImportError, AttributeError, TypeError, ValueError):
            continue
        seen.add(full)
        out.append({"messages": [turns[0], {"role": "assistant", "content": _first_sentence(turns[1]["content"])},
                                 {"role": "user", "content": "How do I call it?"}],
                    "name": full, "signature": f"`{full}{sig}`", "params": [p for p in sig.parameters if p != "self"]})
    return out


def _text(completion) -> str:
    if isinstance(completion, list):  # conversational: [{"role": "assistant", "content": ...}]
        return completion[-1].get("content", "") if completion else ""
    return completion


def signature_reward(completions, signature, **kwargs) -> list[float]:
    """difflib's similarity ratio of the answer to the true "`name(signature)`" (1.0: exactly it)."""
    return [difflib.SequenceMatcher(None, _text(c).strip(), want, autojunk=False).ratio()
            for c, want in zip(completions, signature)]


def format_reward(completions, completion_ids=None, **kwargs) -> list[float]:
    """1.0 for an answer that is one backticked call, "`name(...)`", and nothing else."""
    return [1.0 if _CALL.fullmatch(_text(c).strip()) else 0.0 for c in completions]


def params_reward(completions, params, **kwargs) -> list[float]:
    """F1 of the parameter names inside the answer's first (...) against the real signature's; an
    answer with no parentheses scores 0, a function without parameters scores 1 for "()"."""
    out = []
    for completion, want in zip(completions, params):
        m = re.search(r"\(([^()]*)\)", _text(completion))
        if m is None:
            out.append(0.0)
            continue
        got = {re.sub(r"[^\w]", "", part.split("=")[0].split(":")[0]) for part in m.group(1).split(",")} - {""}
        want = set(want)
        if not want:
            out.append(1.0 if not got else 0.0)
            continue
        hit = len(got & want)
        out.append(0.0 if not hit else 2 * hit / (len(got) + len(want)))
    return out
