"""torchmeg: compiler-first, verifiable large-model training on PyTorch's own parts.

Public API (resolved on first use, PEP 562, so `import torchmeg` stays cheap and free of
torch.distributed side effects): parallelize, ParallelDims, Config, load_config, ConfigError,
validate, Layout, build_model, register, ModelSpec, init_weights.
"""
__version__ = "0.1.0"


def __getattr__(name):
    # Each import below is lazy by design (see the docstring).
    if name == "parallelize":
        from torchmeg.parallel.parallelize import parallelize
        return parallelize
    if name == "ParallelDims":
        from torchmeg.parallel.dims import ParallelDims
        return ParallelDims
    if name in ("load_config", "Config", "ConfigError"):
        from torchmeg import config
        return getattr(config, name)
    if name == "validate":
        from torchmeg.validate import validate
        return validate
    if name == "Layout":
        from torchmeg.layout import Layout
        return Layout
    if name in ("build_model", "register", "ModelSpec", "init_weights"):
        from torchmeg import models
        return getattr(models, name)
    raise AttributeError(name)
