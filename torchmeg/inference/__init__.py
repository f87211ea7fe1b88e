"""Using a trained model: loaded in any layout (trained.py), TP beyond the KV heads (kv_replicas.py),
and the CLIs `python -m torchmeg.generate` (generate.py) and `python -m torchmeg.eval` (evaluate.py);
decoding itself is torchmeg.batching's.
"""
