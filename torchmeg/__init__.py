"""torchmeg: compiler-first, verifiable large-model training on PyTorch's own parts.

Public API (resolved on first use, PEP 562, so `import torchmeg` stays cheap and free of
torch.distributed side effects): parallelize, ParallelDims, Config, load_config, ConfigError,
validate, Layout, build_model, register, ModelSpec, init_weights.
"""
__version__ = "0.1.0"

import importlib as _importlib
import logging as _logging


class _TorchaoEnumNotice(_logging.Filter):
    """torchao (0.18) registers its Enums with torch's pytree at import, and torch 2.13 logs a
    deprecation for each ("<enum 'KernelPreference'> is an Enum subclass ... register_constant() is
    deprecated") on every rank of every run that imports it: only that message, for torchao's
    classes, is dropped; every other pytree warning still shows."""

    def filter(self, record):
        return not (record.getMessage().find("is an Enum subclass") >= 0 and record.args
                    and getattr(record.args[0], "__module__", "").startswith("torchao"))


_logging.getLogger("torch.utils._pytree").addFilter(_TorchaoEnumNotice())


def _facade(package: str, public: dict[str, str]):
    """A package's PEP 562 `__getattr__`: a public name is imported from the module `public` names,
    by module path (importlib), on first use. Never by a from-import of the package itself: `from
    pkg import sub` first asks pkg for the attribute `sub`, which would call this again, forever,
    while `sub` is not loaded yet (`torchmeg.Config()` in a fresh interpreter was a RecursionError).
    Anything else is an AttributeError naming it."""
    def __getattr__(name: str):
        if name not in public:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        return getattr(_importlib.import_module(public[name]), name)
    return __getattr__


# Each public name and the module it lives in.
_PUBLIC = {
    "parallelize": "torchmeg.parallel.parallelize",
    "ParallelDims": "torchmeg.parallel.dims",
    "Config": "torchmeg.config.schema",
    "load_config": "torchmeg.config.schema",
    "ConfigError": "torchmeg.config.errors",
    "validate": "torchmeg.train.validate",
    "Layout": "torchmeg.config.layout",
    "build_model": "torchmeg.models.args",
    "register": "torchmeg.models.spec",
    "ModelSpec": "torchmeg.models.spec",
    "init_weights": "torchmeg.models.init",
}
__all__ = sorted(_PUBLIC)
__getattr__ = _facade(__name__, _PUBLIC)
