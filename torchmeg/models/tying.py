"""Tied parameters (one tensor reachable under two names, e.g. a tied embedding and LM head):
found before a transform that replaces parameters one module at a time, and tied again after it."""
from __future__ import annotations

from torch import nn


def tied_pairs(model: nn.Module) -> list[tuple[str, str]]:
    """(first FQN, other FQN) for every parameter reachable under two names."""
    first, pairs = {}, []
    for mname, mod in model.named_modules():
        for pname, p in mod.named_parameters(recurse=False):
            fqn = f"{mname}.{pname}" if mname else pname
            if id(p) in first:
                pairs.append((first[id(p)], fqn))
            else:
                first[id(p)] = fqn
    return pairs


def get_param_owner(model: nn.Module, fqn: str) -> tuple[nn.Module, str]:
    mod, _, name = fqn.rpartition(".")
    return model.get_submodule(mod), name


def retie(model: nn.Module, pairs) -> None:
    for src, dst in pairs:
        sm, sn = get_param_owner(model, src)
        dm, dn = get_param_owner(model, dst)
        setattr(dm, dn, getattr(sm, sn))
