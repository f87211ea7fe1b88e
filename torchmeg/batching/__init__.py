"""Generation from a model in torchmeg's interface, below every user of it (the serving API, the CLIs,
GRPO's rollouts in the trainer): sampling and static-batch generation (generation.py), and the
continuous-batching engine — engine.py (one step: schedule -> run -> sample -> output), scheduler.py,
blocks.py (the KV pool's blocks), runner.py, paged.py (the paged KV cache), sampler.py, output.py
(incremental detokenization, stops), metrics.py (Prometheus). Imports config and models only.
"""
