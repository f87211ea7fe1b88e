"""Prompts for online RL (training.objective = "grpo"): records -> token ids, the text the reward
functions see, and every other column, handed to them as TRL hands them.

A record is `{"prompt": "text"}` (used as it is and tokenized as the tokenizer is configured, its BOS
included where its post-processor adds one, as TRL tokenizes a standard prompt) or `{"messages": [...]}`
(a conversation, rendered with the chat template and its generation prompt: TRL's conversational
format), JSON lines or Parquet rows; or the built-in `python_stdlib_names`
(torchmeg.data.name_task). Every other key of a record is a column: its value reaches the reward
functions as a keyword (e.g. `answer`, `tests`).

The order is a permutation per epoch, a function of (seed, epoch): step s of a run (num_iterations
steps per batch of rollouts) takes the prompts at positions ((s - 1) // num_iterations) x
prompts_per_step onwards in that stream, under every layout and after any resume.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from torchmeg.data.chat import ChatDataError, check_turns, token_offsets
from torchmeg.data.chat_data import read_json_records

from torchmeg.data.sources import BUILTIN_PROMPTS


@dataclass
class Prompt:
    ids: list[int]
    prompt: object               # what the reward functions get: the string, or the messages
    columns: dict = field(default_factory=dict)
    where: str = ""


def _messages(value, where: str) -> list[dict]:
    check_turns(value, where)
    if value[-1]["role"] == "assistant":
        raise ChatDataError(f"{where}: the last message is the assistant's; a prompt ends where the model answers")
    return value


def records(path: str):
    """Yield (where, record) of a prompt file, or of the built-in set."""
    if path == BUILTIN_PROMPTS:
        from torchmeg.data.name_task import name_prompts  # lazy: the built-in task reads the stdlib's modules
        yield from ((f"{BUILTIN_PROMPTS}[{i}]", r) for i, r in enumerate(name_prompts()))
        return
    yield from read_json_records(path)


class PromptSet:
    """Every prompt of `paths`, tokenized; ChatDataError naming the record for anything wrong."""

    def __init__(self, paths: list[str], tokenizer, template, max_prompt_length: int, seq_len: int,
                 max_completion_length: int, seed: int):
        self.items: list[Prompt] = []
        self.seed = seed
        self._order = (-1, None)  # (epoch, its permutation): a step's prompts mostly share one
        for path in paths:
            for where, record in records(path):
                self.items.append(self._encode(record, where, tokenizer, template, max_prompt_length))
        # the columns of every record, in first-seen order: a record without one hands it on as None (TRL)
        self.columns = list(dict.fromkeys(k for p in self.items for k in p.columns))
        if not self.items:
            raise ChatDataError(f"{', '.join(paths)}: no prompts (a record per line: {{\"prompt\": ...}} or "
                                f"{{\"messages\": [...]}})")
        longest = max(self.items, key=lambda p: len(p.ids))
        if len(longest.ids) + max_completion_length > seq_len:
            raise ChatDataError(f"{longest.where}: its prompt ({len(longest.ids)} tokens) + grpo.max_completion_length "
                                f"{max_completion_length} exceed data.seq_len {seq_len} (a rollout's row); raise "
                                f"data.seq_len or lower grpo.max_prompt_length / max_completion_length")

    @staticmethod
    def _encode(record, where: str, tokenizer, template, max_prompt_length: int) -> Prompt:
        if not isinstance(record, dict):
            raise ChatDataError(f"{where}: a prompt record is a JSON object with 'prompt' or 'messages'")
        columns = {k: v for k, v in record.items() if k not in ("prompt", "messages")}
        if "messages" in record or isinstance(record.get("prompt"), list):
            messages = _messages(record.get("messages", record.get("prompt")), where)
            if template is None:
                raise ChatDataError(f"{where}: a conversational prompt needs a chat template (data.chat_template)")
            text, shown = template.render(messages, add_generation_prompt=True), messages
        elif isinstance(record.get("prompt"), str) and record["prompt"]:
            text = shown = record["prompt"]
        else:
            raise ChatDataError(f"{where}: no prompt (a non-empty 'prompt' string or a 'messages' list)")
        if shown is text:  # a standard prompt: tokenized as the tokenizer is configured (its BOS), as TRL does
            ids = tokenizer.encode_with_specials(text)
        else:  # a rendered conversation holds its special tokens as text already (apply_chat_template's ids)
            ids = [int(i) for i in token_offsets(tokenizer, text)[0]]
        if not ids:
            raise ChatDataError(f"{where}: the prompt is empty once tokenized")
        if len(ids) > max_prompt_length:
            raise ChatDataError(f"{where}: the prompt is {len(ids)} tokens, over grpo.max_prompt_length "
                                f"{max_prompt_length}; raise it or drop the record")
        return Prompt(ids, shown, columns, where)

    def __len__(self) -> int:
        return len(self.items)

    def at(self, position: int) -> Prompt:
        """The prompt at `position` of the endless stream: epoch position // n, in that epoch's order."""
        n = len(self.items)
        epoch, i = divmod(position, n)
        if self._order[0] != epoch:
            self._order = (epoch, np.random.default_rng([self.seed, epoch]).permutation(n))
        return self.items[int(self._order[1][i])]
