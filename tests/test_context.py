"""Context parallel: the sequence split over ranks trains exactly like one process."""
import pytest
import torch

from conftest import reference_run, TINY, assert_parity, read_metrics, run_cli
from torchmeg.config import ConfigError, load_config, validate
from torchmeg.parallel.context import positions, shard_sequence

P = "--parallelism."
BASE = TINY + ["--training.steps=4", "--training.deterministic=true", "--training.global_batch_size=4"]


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    cache = {}

    def get(model=()):
        if model not in cache:
            cache[model] = reference_run(tmp_path_factory, _args(model) + ["--training.local_batch_size=4"])
        return cache[model]
    return get


def _args(model):
    if model == ("gpt2",):
        return [a for a in BASE if not a.startswith(("--model.n_kv_heads", "--model.multiple_of"))] + ["--model.name=gpt2"]
    return list(BASE)


@pytest.mark.parametrize("name, ranks, local, layout, model", [
    ("cp2", 2, 4, [P + "context_parallel_degree=2"], ()),
    ("cp2_tp2", 4, 4, [P + "context_parallel_degree=2", P + "tensor_parallel_degree=2"], ()),
    ("cp2_fsdp2", 4, 2, [P + "context_parallel_degree=2", P + "data_parallel_shard_degree=2"], ()),
    ("gpt2_cp2", 2, 4, [P + "context_parallel_degree=2"], ("gpt2",)),
])
def test_cp_matches_single_process(name, ranks, local, layout, model, tmp_path, reference):
    p = run_cli(_args(model) + [f"--training.local_batch_size={local}"] + layout, tmp_path, nproc=ranks)
    assert "cp=2" in p.stdout
    assert_parity(reference(model), read_metrics(tmp_path))


def test_load_balanced_layout():
    seq = torch.arange(16).view(1, 16)
    shards = [shard_sequence(seq, r, 2) for r in range(2)]
    assert shards[0].tolist() == [[0, 1, 2, 3, 12, 13, 14, 15]] and shards[1].tolist() == [[4, 5, 6, 7, 8, 9, 10, 11]]
    for r in range(2):
        assert positions(8, r, 2).tolist() == shards[r][0].tolist()
    # each rank does the same amount of causal attention work
    work = [sum(int(p) + 1 for p in positions(8, r, 2)) for r in range(2)]
    assert work[0] == work[1]


def test_bad_cp_layouts():
    cfg = load_config(None, TINY + ["--data.seq_len=34", P + "context_parallel_degree=2"])
    with pytest.raises(ConfigError, match="data.seq_len = 34: context parallel 2 needs a multiple of 4"):
        validate(cfg, world_size=2)
    cfg = load_config(None, TINY + ["--data.seq_len=36", P + "context_parallel_degree=2", P + "tensor_parallel_degree=2"])
    with pytest.raises(ConfigError, match="multiple of 8"):
        validate(cfg, world_size=4)
    cfg = load_config(None, TINY + [P + "context_parallel_degree=2", P + "pipeline_parallel_degree=2",
                                    "--model.n_layers=4"])
    with pytest.raises(ConfigError, match="not yet supported"):
        validate(cfg, world_size=4)
