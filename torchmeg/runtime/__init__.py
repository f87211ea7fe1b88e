"""Process-level plumbing every CLI shares: the device, process group, collective timeouts and
SIGTERM stop (process.py), the exit policy and hang watchdog (guard.py), and torchrun with one-line
failures across machines (launch.py; `python -m torchmeg.launch`).
"""
