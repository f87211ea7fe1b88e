"""Loss-spike guard: flags a loss above k x the running median, names its batch, logs / skips / stops."""
import pytest

from conftest import TINY, read_metrics
from launch import run_cli
from torchmeg.train.spike import MIN_HISTORY, SpikeGuard, batch_samples

SPIKE = {"TORCHMEG_TEST_SPIKE_AT_STEP": "15"}  # step 15's loss (and gradients) x 50
ARGS = TINY + ["--training.steps=18", "--training.deterministic=true", "--validation.enable=false",
               "--training.loss_spike_factor=3"]


def test_guard_median_window_and_history():
    g = SpikeGuard(factor=3.0, window=20, action="skip")
    for x in [2.0] * (MIN_HISTORY - 1):
        g.record(x)
    assert g.check(100.0) is None  # too little history to judge
    g.record(2.0)
    assert g.check(5.9) is None and "median 2.0000" in g.check(6.1)
    for x in [1.0] * 30:  # the window slides: only the last 20 count
        g.record(x)
    assert len(g.state()) == 20 and g.check(3.1) is not None
    h = SpikeGuard(3.0, 20, "log")
    h.load(g.state() + [9.0] * 5)  # a longer saved history keeps its newest `window`
    assert h.state()[-1] == 9.0 and len(h.state()) == 20
    off = SpikeGuard(0.0, 20, "log")
    off.record(1.0)
    assert off.check(1e9) is None and off.state() == []
    assert batch_samples(15, 4) == (56, 60) and batch_samples(1, 8, offset=3) == (3, 11)


@pytest.mark.slow
@pytest.mark.parametrize("action", ["log", "skip"])
def test_injected_spike_is_reported(action, tmp_path):
    p = run_cli(ARGS + [f"--training.on_loss_spike={action}"], tmp_path, env=SPIKE)
    rows = {r["step"]: r for r in read_metrics(tmp_path)}
    assert [s for s, r in rows.items() if r.get("loss_spike")] == [15]
    # TINY: local batch 4 x dp 1 x accum 1: step 15 reads global samples [56, 60).
    assert "loss spike at step 15" in p.stdout and "global samples [56, 60)" in p.stdout
    assert rows[15].get("skipped", False) == (action == "skip")
    assert "LOSS SPIKE" in p.stdout


@pytest.mark.slow
def test_skip_drops_the_update_and_stop_exits(tmp_path):
    run_cli(ARGS + ["--training.on_loss_spike=log"], tmp_path, name="log", env=SPIKE)
    run_cli(ARGS + ["--training.on_loss_spike=skip"], tmp_path, name="skip", env=SPIKE)
    run_cli(ARGS + ["--training.on_loss_spike=skip"], tmp_path, name="clean")
    log, skip, clean = ({r["step"]: r for r in read_metrics(tmp_path, n)} for n in ("log", "skip", "clean"))
    assert [log[s]["loss"] for s in range(1, 16)] == [skip[s]["loss"] for s in range(1, 16)]
    assert not any(r.get("loss_spike") for r in clean.values())
    # Skipping leaves the step-14 weights for step 16: another trajectory than applying it.
    assert skip[16]["loss"] != log[16]["loss"]
    p = run_cli(ARGS + ["--training.on_loss_spike=stop"], tmp_path, name="stop", env=SPIKE, check=False)
    assert p.returncode == 1 and "loss spike at step 15" in p.stderr and "on_loss_spike" in p.stderr
    assert max(r["step"] for r in read_metrics(tmp_path, "stop")) == 14


@pytest.mark.slow
def test_resumed_run_judges_spikes_as_an_uninterrupted_one(tmp_path):
    """The loss history is in the checkpoint: resumed at step 12, the spike at 15 is still seen
    against 14 steps of history (without it, 3 steps would be too few to judge) and skipped alike."""
    args = ARGS + ["--training.on_loss_spike=skip", "--checkpoint.enable=true", "--checkpoint.interval=12",
                   "--checkpoint.async_mode=disabled"]
    run_cli(args, tmp_path, name="full", env=SPIKE)
    p = run_cli(args, tmp_path, name="cut", env=dict(SPIKE, TORCHMEG_TEST_KILL_AT_STEP="12"), check=False)
    assert p.returncode != 0
    p = run_cli(args, tmp_path, name="cut", env=SPIKE)
    assert "resumed   from step 12" in p.stdout
    full, cut = ({r["step"]: r for r in read_metrics(tmp_path, n)} for n in ("full", "cut"))
    assert cut[15].get("skipped") and cut[15].get("loss_spike")
    for s in range(13, 19):
        assert (full[s]["loss"], full[s]["grad_norm"]) == (cut[s]["loss"], cut[s]["grad_norm"]), s
