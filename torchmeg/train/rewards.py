"""GRPO's reward functions: named in the recipe as 'module:function' ([grpo] reward_funcs), imported
before anything launches, called as TRL's GRPOTrainer calls them:

    f(prompts=[...], completions=[...], completion_ids=[[...]], trainer_state=..., <column>=[...], ...)
      -> a float (or None: "does not apply") per completion

(every record column other than the prompt as a keyword list, one value per completion), so a reward
function written for TRL runs here unchanged. A function that raises, returns the wrong count, or a
value that is not a finite number fails the step with one line naming it. A column a record lacks
reaches the functions as None for that record (as TRL's datasets give it).
"""
from __future__ import annotations

import importlib
import math
import os
import sys
import types

from torchmeg.config.errors import ConfigError, InputError


class RewardError(InputError):
    """A reward function failed or returned something that is not a reward (one line)."""


def load_reward_funcs(specs: list, weights: list) -> tuple[list[tuple[str, object]], list[float]]:
    """[(name, callable)] and their weights from grpo.reward_funcs / reward_weights."""
    if not specs:
        raise ConfigError("grpo.reward_funcs = []: training.objective = \"grpo\" needs at least one reward function "
                          "('module:function', e.g. 'torchmeg.data.name_task:call_reward')")
    if weights and len(weights) != len(specs):
        raise ConfigError(f"grpo.reward_weights = {weights}: one weight per grpo.reward_funcs entry ({len(specs)}), "
                          f"or [] for all 1")
    if os.getcwd() not in sys.path:  # a reward module beside the recipe's working directory imports as a script would
        sys.path.insert(0, os.getcwd())
    funcs = []
    for spec in specs:
        module, sep, name = str(spec).partition(":")
        if not sep or not module or not name:
            raise ConfigError(f"grpo.reward_funcs: {spec!r} is not 'module:function' (e.g. 'my_rewards:accuracy')")
        try:
            mod = importlib.import_module(module)
        except Exception as e:  # noqa: BLE001 - any import failure is the recipe's to fix
            raise ConfigError(f"grpo.reward_funcs: {spec!r}: module {module!r} cannot be imported "
                              f"({type(e).__name__}: {e})") from None
        fn = getattr(mod, name, None)
        if not callable(fn):
            raise ConfigError(f"grpo.reward_funcs: {spec!r}: {module} has no function {name!r}")
        funcs.append((name, fn))
    return funcs, [float(w) for w in weights] or [1.0] * len(funcs)


def call_rewards(funcs, prompts: list, completions: list, completion_ids: list[list[int]], columns: dict,
                 step: int) -> list[list[float]]:
    """[completions][funcs] rewards (NaN where a function returned None)."""
    state = types.SimpleNamespace(global_step=step)
    out = [[math.nan] * len(funcs) for _ in completions]
    for j, (name, fn) in enumerate(funcs):
        try:
            values = fn(prompts=prompts, completions=completions, completion_ids=completion_ids, trainer_state=state,
                        **columns)
        except Exception as e:  # noqa: BLE001 - the user's function: its failure, named
            raise RewardError(f"reward function {name!r} raised {type(e).__name__}: {e}") from None
        try:
            values = list(values)
        except TypeError:
            raise RewardError(f"reward function {name!r} returned {type(values).__name__}, not a list of floats "
                              f"(one per completion)") from None
        if len(values) != len(completions):
            raise RewardError(f"reward function {name!r} returned {len(values)} values for {len(completions)} "
                              f"completions (one per completion)")
        for i, v in enumerate(values):
            if v is None:
                continue
            if isinstance(v, (str, bytes)) or not hasattr(v, "__float__"):
                raise RewardError(f"reward function {name!r} returned {v!r} ({type(v).__name__}) for completion {i}; "
                                  f"a reward is a float (or None)")
            if not math.isfinite(float(v)):  # (a NaN trained on silently: reward nan, gradient 0; an inf
                raise RewardError(          # zeroed its group's advantages)
                    f"reward function {name!r} returned {float(v)} for completion {i} at step {step}; a reward is a "
                    f"finite float, or None where it does not apply")
            out[i][j] = float(v)
    return out
