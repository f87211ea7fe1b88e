"""The recipe keys named after TRL's take TRL's defaults (TRL 1.16's `GRPOConfig`, `DPOConfig` and `SFTConfig`, read
from TRL itself): a user who sets nothing runs TRL's algorithm. Where torchmeg spells "off" its own way
(-1, 0, [] for TRL's None) the mapping is named here; keys TRL does not have are left out."""
from __future__ import annotations

import dataclasses

import pytest

trl = pytest.importorskip("trl")  # the test extra

# torchmeg's spelling of TRL's None: "the same as epsilon", "off", "all weights 1"
NONE_AS = {"epsilon_high": -1.0, "delta": 0.0, "reward_weights": [], "loss_weights": []}


def _defaults(cls) -> dict:
    out = {}
    for f in dataclasses.fields(cls):
        if f.default is not dataclasses.MISSING:
            out[f.name] = f.default
        elif f.default_factory is not dataclasses.MISSING:
            out[f.name] = f.default_factory()
    return out


def _compare(ours: dict, theirs: dict, names: dict) -> list[str]:
    """names: our key -> TRL's; -> the keys compared (each asserted equal)."""
    compared = []
    for key, their_key in names.items():
        want = theirs[their_key]
        want = NONE_AS.get(key, want) if want is None else want
        if isinstance(want, list) and len(want) == 1 and isinstance(ours[key], str):
            want = want[0]  # (TRL's loss_type list of one; ours a string, "," joining several)
        assert ours[key] == want, (key, ours[key], their_key, theirs[their_key])
        compared.append(key)
    return compared


def test_grpo_keys_take_trls_defaults():
    from torchmeg.config.sections import Grpo
    ours, theirs = _defaults(Grpo), _defaults(trl.GRPOConfig)
    shared = {k: k for k in ours if k in theirs}
    assert len(_compare(ours, theirs, shared)) >= 20, sorted(shared)


def test_dpo_keys_take_trls_defaults():
    from torchmeg.config.sections import Dpo, Training
    ours, theirs = {**_defaults(Dpo), **_defaults(Training)}, _defaults(trl.DPOConfig)
    assert _compare(ours, theirs, {"dpo_beta": "beta", "dpo_loss_type": "loss_type", "label_smoothing": "label_smoothing",
                                   "loss_weights": "loss_weights"})


def test_sft_target_keys_take_trls_defaults():
    """`data.assistant_only_loss` and `data.completion_only_loss` are SFTConfig's (its None for
    completion_only_loss means true for the prompt-completion records it applies to)."""
    from torchmeg.config.sections import Data
    ours, theirs = _defaults(Data), _defaults(trl.SFTConfig)
    assert ours["assistant_only_loss"] is theirs["assistant_only_loss"] is False
    assert ours["completion_only_loss"] is True and theirs["completion_only_loss"] in (None, True)
    assert ours["train_on_prompt"] is False  # (torchmeg's override: every token whatever the two say)
