from torchmeg.parallel.dims import ParallelDims  # noqa: F401
