"""Serving a trained model: OpenAI-compatible HTTP (api.py, protocol.py) over the continuous-batching
engine (torchmeg.batching); the CLI `python -m torchmeg.serve` (cli.py).
"""
