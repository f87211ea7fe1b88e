"""What a run reports: the per-step metrics, JSONL and TensorBoard (metrics.py), the peak FLOP/s MFU
is measured against (peak.py), profiler windows (profiling.py), what actually ran in step 1
(op_record.py), and the run header (run_header.py).
"""
