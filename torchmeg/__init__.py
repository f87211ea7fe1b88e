"""torchmeg: compiler-first, verifiable large-model training on PyTorch's own parts."""
__version__ = "0.1.0"


def __getattr__(name):
    # Lazy public API: `import torchmeg` stays cheap and free of torch.distributed side effects.
    if name in ("parallelize",):
        from torchmeg.parallel.parallelize import parallelize
        return parallelize
    if name == "ParallelDims":
        from torchmeg.parallel.dims import ParallelDims
        return ParallelDims
    if name in ("load_config", "validate", "Config", "ConfigError"):
        from torchmeg import config
        return getattr(config, name)
    if name in ("build_model", "register", "ModelSpec", "init_weights"):
        from torchmeg import models
        return getattr(models, name)
    raise AttributeError(name)
