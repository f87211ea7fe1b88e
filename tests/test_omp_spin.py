"""torchmeg/runtime/omp_spin.py: on a CPU already busy when `python -m torchmeg.train` starts, libgomp's
waiting threads spin 1,000 times instead of 300,000 before they sleep (1.9x faster beside two busy
processes, 7% slower quiet: docs/getting-started.md), said in one line; a user's own setting is kept."""
import os
import subprocess
import sys

import pytest

from launch import ROOT
from torchmeg.runtime import omp_spin

NOT_LOADED = {}  # (the test process has torch imported; the CLI decides before it imports it)


def test_a_busy_cpu_gets_fewer_spins_and_a_quiet_one_none():
    env = {}
    line = omp_spin.spin_less_when_busy(env, load=2.0, cores=2, modules=NOT_LOADED)
    assert env == {"GOMP_SPINCOUNT": "1000"} and "busy (load 2.0 on 2 cores)" in line and "GOMP_SPINCOUNT=1000" in line
    env = {}
    assert omp_spin.spin_less_when_busy(env, load=1.9, cores=2, modules=NOT_LOADED) is None and env == {}


@pytest.mark.parametrize("own", [{"GOMP_SPINCOUNT": "300000"}, {"OMP_WAIT_POLICY": "active"}])
def test_a_users_own_setting_is_kept(own):
    env = dict(own)
    assert omp_spin.spin_less_when_busy(env, load=9.0, cores=2, modules=NOT_LOADED) is None and env == own


def test_nothing_is_set_once_torch_is_imported():
    """libgomp read its spin count when torch loaded: setting it after would only mislead."""
    env = {}
    assert omp_spin.spin_less_when_busy(env, load=9.0, cores=2, modules={"torch": object()}) is None and env == {}


def test_the_line_is_printed_on_each_nodes_first_rank_only(capsys):
    for local_rank, printed in [(None, True), ("0", True), ("1", False)]:
        env = {} if local_rank is None else {"LOCAL_RANK": local_rank}
        omp_spin.apply(env, load=4.0, cores=2, modules=NOT_LOADED)
        assert env["GOMP_SPINCOUNT"] == "1000"
        assert ("the CPU is busy" in capsys.readouterr().out) == printed, local_rank


@pytest.mark.slow
def test_the_cli_decides_before_it_imports_torch(tmp_path):
    """`python -m torchmeg.train` in a fresh interpreter whose load average reads busy: the line is
    printed (so the decision ran before torch was imported: after, it sets nothing) and the run trains."""
    env = {k: v for k, v in os.environ.items() if k not in ("GOMP_SPINCOUNT", "OMP_WAIT_POLICY", "LOCAL_RANK")}
    code = ("import os, runpy, sys; os.getloadavg = lambda: (64.0, 64.0, 64.0); "
            "sys.argv = ['torchmeg.train'] + sys.argv[1:]; runpy.run_module('torchmeg.train', run_name='__main__')")
    p = subprocess.run([sys.executable, "-c", code, "--config", "recipes/debug_llama.toml", "--training.steps=1",
                        "--model.n_layers=1", "--model.dim=64", "--data.seq_len=32", "--metrics.enable_tensorboard=false",
                        "--validation.enable=false", "--checkpoint.enable=false", f"--job.dump_folder={tmp_path}"],
                       cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr[-3000:]
    assert p.stdout.splitlines()[0].startswith("torchmeg: the CPU is busy (load 64.0 on "), p.stdout[:500]
    assert "GOMP_SPINCOUNT=1000" in p.stdout and "step     1 |" in p.stdout, p.stdout[-2000:]
