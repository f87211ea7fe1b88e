"""The CPU peak that MFU divides by: a probe on a busy machine must never become the machine's peak."""
import json
import os
import subprocess
import sys
import time

import pytest
import torch

from torchmeg.observe import peak


def _hogs(n: int) -> list[subprocess.Popen]:
    return [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(n)]


@pytest.mark.slow
def test_probe_under_load_is_not_cached(tmp_path):
    """Spinning processes on every core (and one more) take the probe's cores away: it sees its own
    CPU share fall, uses the number for this run only and writes nothing. (More load from elsewhere
    only makes it busier: the test holds on a shared machine.)"""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        cores = len(os.sched_getaffinity(0))
        hogs = _hogs(cores + 1)
        try:
            time.sleep(0.5)  # let them be scheduled
            flops, source = peak.peak_flops(torch.device("cpu"), torch.float32, str(tmp_path))
        finally:
            for h in hogs:
                h.kill()
                h.wait()
        assert flops > 0
        assert "BUSY" in source and "not cached" in source, source
        assert not (tmp_path / "peak_flops.json").exists()
    finally:
        torch.set_num_threads(threads)


def test_clean_probe_is_cached_and_read_back(tmp_path, monkeypatch):
    """A clean probe (its threads got the CPU) is cached with how and when it was taken, and the
    next run reads it instead of probing. The probe is a stand-in with an idle machine's share:
    whether this machine is idle while the suite runs is not the test's to control."""
    calls = []

    def clean_probe(dtype):
        calls.append(dtype)
        return peak.Probe(1.25e11, 0.99, torch.get_num_threads(), 1024, peak.ROUNDS, time.time())

    monkeypatch.setattr(peak, "probe_cpu", clean_probe)
    flops, source = peak.peak_flops(torch.device("cpu"), torch.float32, str(tmp_path))
    assert flops == 1.25e11 and "measured now" in source and "cached in" in source, source
    (entry,) = json.loads((tmp_path / "peak_flops.json").read_text()).values()
    assert entry["cpu_share"] >= peak.CLEAN_SHARE and entry["rounds"] == peak.ROUNDS and entry["taken"] > 0
    again, source2 = peak.peak_flops(torch.device("cpu"), torch.float32, str(tmp_path))
    assert again == flops and len(calls) == 1 and "cpu share" in source2 and "taken" in source2, source2


def test_untrusted_cache_entries_are_probed_again(tmp_path):
    """An entry of the old format (a bare number from an unknown probe), a contended one, or a stale
    one is not used as the peak."""
    path = tmp_path / "peak_flops.json"
    key = peak._cache_key(torch.float32)
    good = peak.Probe(1e11, 0.99, torch.get_num_threads(), 1024, 5, time.time())
    cases = {
        "legacy": 6.8e10,
        "busy": dict(vars(good), flops=6.8e10, cpu_share=0.4),
        "stale": dict(vars(good), flops=6.8e10, taken=time.time() - (peak.STALE_DAYS + 1) * 86400),
    }
    for name, entry in cases.items():
        path.write_text(json.dumps({key: entry}))
        assert peak._cached(str(path), torch.float32) is None, name
    path.write_text(json.dumps({key: vars(good)}))
    assert peak._cached(str(path), torch.float32).flops == 1e11
    # A contended probe is never stored, whatever the table held.
    peak._store(str(path), torch.float32, peak.Probe(5e10, 0.5, 1, 1024, 5, time.time()))
    assert json.loads(path.read_text())[key]["flops"] == 1e11


@pytest.mark.parametrize("bf16_flops, said", [(1.1e9, True), (2.0e11, False)])
def test_a_bf16_run_on_a_cpu_slow_at_bf16_is_told_fp32_trains_faster(tmp_path, monkeypatch, bf16_flops, said):
    """A CPU without bf16 units runs bf16 matmuls in ATen's fallback: 1.1 GFLOP/s against float32's 118 on
    the AVX2 EPYC. A bf16 run there gets a clause naming the ratio and training.mixed_precision = "fp32"
    (float32's peak probed once and cached beside bf16's); a CPU whose bf16 is as fast (AMX, AVX512-BF16:
    the second case) and a float32 run get none. Stand-in probes: the machine's own are its own."""
    probes = {torch.float32: 1.18e11, torch.bfloat16: bf16_flops}
    calls = []

    def probe(dtype):
        calls.append(dtype)
        return peak.Probe(probes[dtype], 0.99, torch.get_num_threads(), 1024, peak.ROUNDS, time.time())

    monkeypatch.setattr(peak, "probe_cpu", probe)
    flops, source = peak.peak_flops(torch.device("cpu"), torch.bfloat16, str(tmp_path))
    assert flops == bf16_flops and calls == [torch.bfloat16, torch.float32]
    assert ('bfloat16 matmuls run 107x slower than float32\'s (0.118 TFLOP/s) on this CPU: '
            'training.mixed_precision = "fp32" trains faster here' in source) == said, source
    again, source2 = peak.peak_flops(torch.device("cpu"), torch.bfloat16, str(tmp_path))  # both read back
    assert again == flops and len(calls) == 2 and ("107x slower" in source2) == said, source2
    _, fp32_source = peak.peak_flops(torch.device("cpu"), torch.float32, str(tmp_path))
    assert "slower than" not in fp32_source and len(calls) == 2
    # A cached bf16 peak without a float32 one (cached before this clause existed): no probe on a run that
    # read its own peak (it may share the cores with its sibling ranks), so no clause either.
    table = json.loads((tmp_path / "peak_flops.json").read_text())
    del table[peak._cache_key(torch.float32)]
    (tmp_path / "peak_flops.json").write_text(json.dumps(table))
    _, source3 = peak.peak_flops(torch.device("cpu"), torch.bfloat16, str(tmp_path))
    assert len(calls) == 2 and "slower than" not in source3, source3
