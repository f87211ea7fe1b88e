"""Using a trained model: the decoding engine (engine.py: prefill, KV-cache decode, sampling), a
trained model loaded in any layout (trained.py), and the CLIs `python -m torchmeg.generate`
(generate.py) and `python -m torchmeg.eval` (evaluate.py).
"""
