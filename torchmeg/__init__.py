"""torchmeg: compiler-first, verifiable large-model training on PyTorch's own parts.

Public API (resolved on first use, PEP 562, so `import torchmeg` stays cheap and free of
torch.distributed side effects): parallelize, ParallelDims, Config, load_config, ConfigError,
validate, Layout, build_model, register, ModelSpec, init_weights.
"""
__version__ = "0.1.0"

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


def __getattr__(name):
    # Each import below is lazy by design (see the docstring).
    if name == "parallelize":
        from torchmeg.parallel.parallelize import parallelize
        return parallelize
    if name == "ParallelDims":
        from torchmeg.parallel.dims import ParallelDims
        return ParallelDims
    if name in ("load_config", "Config", "ConfigError"):
        from torchmeg.config import schema as config
        return getattr(config, name)
    if name == "validate":
        from torchmeg.train.validate import validate
        return validate
    if name == "Layout":
        from torchmeg.config.layout import Layout
        return Layout
    if name in ("build_model", "register", "ModelSpec", "init_weights"):
        from torchmeg import models
        return getattr(models, name)
    raise AttributeError(name)
