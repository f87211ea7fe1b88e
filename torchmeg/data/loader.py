"""From a recipe's [data] section to batches: open the stores, build the datasets, the stateful loader."""
from __future__ import annotations

import warnings

from torchdata.stateful_dataloader import StatefulDataLoader

from torchmeg.data.dataset import StepSampler, TokenDataset
from torchmeg.data.sources import BUILTIN, dataset_list, resolve
from torchmeg.data.store import open_store
from torchmeg.errors import ConfigError, StoreError

# torchdata's loader logs a harmless deprecation notice (set_vital) that would bury the log.
warnings.filterwarnings("ignore", message=".*set_vital.*")


def open_stores(cfg, tokenizer) -> list:
    stores = []
    for n in dataset_list(cfg):
        try:
            stores.append(open_store(resolve(n, tokenizer, cfg)))
        except StoreError as e:
            fix = "; delete those files and the cache is rebuilt" if n in BUILTIN else ""
            raise ConfigError(f"data.dataset = {n!r}: {e}{fix}") from None
    return stores


def build_dataset(cfg, stores, split: str) -> TokenDataset:
    d = cfg.data
    return TokenDataset(stores, d.weights, d.seq_len, cfg.job.seed, split, d.val_fraction,
                        documents=d.document_masking, mask_eod=d.mask_eod_loss)


def build_loader(dataset, local_batch: int, dp: int, dp_rank: int, accum: int, start_step: int, steps: int,
                 num_workers: int = 0, sample_offset: int = 0) -> StatefulDataLoader:
    """Batches of this dp rank, in step order; its state_dict() can be checkpointed."""
    sampler = StepSampler(local_batch, dp, dp_rank, accum, start_step, steps, sample_offset)
    return StatefulDataLoader(dataset, batch_size=local_batch, sampler=sampler, num_workers=num_workers,
                              drop_last=True, persistent_workers=num_workers > 0)
