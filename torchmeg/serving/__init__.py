"""Serving a trained model: OpenAI-compatible HTTP (api.py, protocol.py) over a continuous-batching
engine (scheduler.py) and its slot KV cache (slots.py); the CLI `python -m torchmeg.serve` (cli.py).
"""
