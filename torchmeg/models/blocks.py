"""Where a model's repeated blocks are: the unit FSDP wraps, compile compiles and recompute wraps.

Any model, not only torchmeg's: the blocks are the children of the ModuleList / ModuleDict /
Sequential of same-class modules holding the most parameters anywhere in the module tree (`layers`
here, `model.layers` in a Hugging Face causal LM, `transformer.h` in nanoGPT), unless the caller
names the container (`parallelize(..., blocks="model.layers")`, recipe key `model.blocks`).
"""
from __future__ import annotations

from torch import nn

CONTAINERS = (nn.ModuleList, nn.ModuleDict, nn.Sequential)
_WRAPPER_PARTS = ("_orig_mod", "_checkpoint_wrapped_module", "_fsdp_wrapped_module")


def canonical_fqn(fqn: str) -> str:
    """The model's own name for a parameter, without compile/recompute/FSDP wrapper components."""
    return ".".join(p for p in fqn.split(".") if p not in _WRAPPER_PARTS)


def _n_params(module: nn.Module) -> int:
    return sum(p.numel() for p in module.parameters())


def find_blocks(model: nn.Module, path: str = "") -> tuple[str, nn.Module | None]:
    """(FQN of the block container, the container); ("", None) if the model has none.

    path: the container's FQN, chosen by the caller; an error if it is not a container.
    Otherwise, among containers whose children are all of one class (repeated blocks; not e.g.
    nanoGPT's `transformer` ModuleDict of embedding, blocks and norm, nor an MLP's Sequential), the
    one holding the most parameters (ties: the shallowest, then the first).
    """
    if path:
        try:
            found = model.get_submodule(path)
        except AttributeError:
            raise ValueError(f"blocks = {path!r}: the model has no submodule of that name; give the FQN of "
                             f"the ModuleList / ModuleDict / Sequential holding its layers") from None
        if not isinstance(found, CONTAINERS):
            raise ValueError(f"blocks = {path!r} is a {type(found).__name__}, not a ModuleList / ModuleDict / "
                             f"Sequential of blocks")
        return path, found
    best, best_key = ("", None), None
    for fqn, mod in model.named_modules():
        if isinstance(mod, CONTAINERS) and len(mod) > 0 and len({type(c) for c in mod.children()}) == 1:
            key = (_n_params(mod), -fqn.count("."))
            if best_key is None or key > best_key:
                best, best_key = (fqn, mod), key
    if best_key is not None and best_key[0] == 0:
        return "", None  # containers of parameter-free modules are not blocks
    return best


def blocks(model: nn.Module, path: str = "") -> list[nn.Module]:
    """The repeated blocks themselves, in order ([] if the model has none)."""
    _, container = find_blocks(model, path)
    if container is None:
        return []
    return list(container.values()) if isinstance(container, nn.ModuleDict) else list(container)


def extra_blocks(model: nn.Module) -> list[nn.Module]:
    """Blocks outside the main container that a model names in `extra_blocks` (FQNs of containers,
    e.g. DeepSeek-V3's MTP modules): FSDP makes each its own unit too."""
    out = []
    for name in getattr(model, "extra_blocks", ()):
        container = getattr(model, name, None)
        if container is not None:
            out += list(container.values()) if isinstance(container, nn.ModuleDict) else list(container)
    return out


def fqn_matches(pattern: str, fqn: str) -> bool:
    """A TP plan's module pattern ("layers.*.attention.wq", `*` one name) against a module's FQN."""
    p, f = pattern.split("."), fqn.split(".")
    return len(p) == len(f) and all(a == "*" or a == b for a, b in zip(p, f))
