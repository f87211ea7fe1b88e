"""From a recipe's [data] section to batches: open the stores, build the datasets, the stateful loader."""
from __future__ import annotations

import contextlib
import time
import warnings

from torchdata.stateful_dataloader import StatefulDataLoader

from torchmeg.data.chat import ChatDataError, chat_template
from torchmeg.data.chat_data import ChatDataset, ChatWindows, Targets, tokenize_conversations
from torchmeg.data.dataset import StepSampler, TokenDataset
from torchmeg.data.pairs import PairDataset, Pairs
from torchmeg.data.prompts import PromptSet
from torchmeg.data.sources import BUILTIN, cache_dir, dataset_list, resolve, stdlib_prefix
from torchmeg.data.store import exists, open_store
from torchmeg.config.errors import ConfigError, StoreError

# torchdata's loader logs a harmless deprecation notice (set_vital) that would bury the log.
warnings.filterwarnings("ignore", message=".*set_vital.*")


@contextlib.contextmanager
def _chat_data_errors():
    """Chat and preference data: a bad file or conversation as the recipe's one-line error."""
    try:
        yield
    except ChatDataError as e:
        raise ConfigError(f"data.dataset: {e}") from None


def open_chat(cfg, tokenizer):
    """training.objective = "sft": the dataset list's conversations, tokenized (torchmeg.data.chat_data)."""
    d = cfg.data
    with _chat_data_errors():
        template = chat_template(cfg)
        return tokenize_conversations(dataset_list(cfg), template, tokenizer, Targets.of(d), cache_dir(cfg))


def open_prompts(cfg, tokenizer):
    """training.objective = "grpo": the prompts (torchmeg.data.prompts), with the chat template when the
    recipe names one (or the tokenizer folder has one; a folder without one: None, and a conversational
    record is then refused in one line) -> (PromptSet, template or None)."""
    d, g = cfg.data, cfg.grpo
    with _chat_data_errors():
        template = chat_template(cfg, required=False)
        return PromptSet(dataset_list(cfg), tokenizer, template, g.max_prompt_length, d.seq_len,
                         g.max_completion_length, cfg.job.seed), template


def open_stores(cfg, tokenizer) -> list:
    if cfg.training.objective == "grpo":
        return list(open_prompts(cfg, tokenizer))
    if cfg.training.objective == "sft":
        return [open_chat(cfg, tokenizer)]
    if cfg.training.objective == "dpo":
        with _chat_data_errors():
            # (standard pairs need no template, as in TRL; a conversational pair without one is refused)
            return [Pairs(dataset_list(cfg), chat_template(cfg, required=False), tokenizer)]
    stores = []
    for n in dataset_list(cfg):
        try:
            stores.append(open_store(resolve(n, tokenizer, cfg)))
        except StoreError as e:
            fix = "; delete those files and the cache is rebuilt" if n in BUILTIN else ""
            raise ConfigError(f"data.dataset = {n!r}: {e}{fix}") from None
    return stores


def prepare_stores(cfg, tokenizer) -> list[str]:
    """Node-local work before any rank opens the stores: the built-in corpus tokenized into this
    node's cache, once per node (local rank 0 calls this; the node's other ranks wait). -> one note
    per built-in corpus: where it is, built now (and in how long) or found."""
    notes = []
    if cfg.training.objective == "grpo":
        t0 = time.perf_counter()
        prompts = open_prompts(cfg, tokenizer)[0]
        return [f"{len(prompts):,} prompts read in {time.perf_counter() - t0:.1f} s"]
    if cfg.training.objective in ("sft", "dpo"):
        t0 = time.perf_counter()
        open_stores(cfg, tokenizer)  # chat data: tokenized into the cache once, here; pairs: checked
        return [f"chat conversations tokenized or found in {time.perf_counter() - t0:.1f} s"]
    for n in dataset_list(cfg):
        if n in BUILTIN:
            prefix, t0 = stdlib_prefix(tokenizer, cfg), time.perf_counter()
            had = exists(prefix)
            resolve(n, tokenizer, cfg)
            notes.append(f"{n} {'found' if had else f'built in {time.perf_counter() - t0:.1f} s'} at {prefix}")
    open_stores(cfg, tokenizer)  # and every store opens (checked) here first
    return notes


def build_dataset(cfg, stores, split: str):
    d = cfg.data
    if cfg.training.objective == "grpo":  # (the prompts; no held-out split: the rewards measure the run)
        return stores[0] if split == "train" else None
    if cfg.training.objective == "dpo":
        with _chat_data_errors():
            return PairDataset(stores[0], d.seq_len, cfg.job.seed, split, d.val_fraction)
    if cfg.training.objective == "sft":
        with _chat_data_errors():
            windows = ChatWindows(stores[0], d.seq_len, split, d.val_fraction, d.long_conversations, pad_id=0)
        return ChatDataset(windows, cfg.job.seed, split, documents=d.document_masking)
    return TokenDataset(stores, d.weights, d.seq_len, cfg.job.seed, split, d.val_fraction,
                        documents=d.document_masking, mask_eod=d.mask_eod_loss)


def build_loader(dataset, local_batch: int, dp: int, dp_rank: int, accum: int, start_step: int, steps: int,
                 num_workers: int = 0, sample_offset: int = 0) -> StatefulDataLoader:
    """Batches of this dp rank, in step order; its state_dict() can be checkpointed."""
    sampler = StepSampler(local_batch, dp, dp_rank, accum, start_step, steps, sample_offset)
    return StatefulDataLoader(dataset, batch_size=local_batch, sampler=sampler, num_workers=num_workers,
                              drop_last=True, persistent_workers=num_workers > 0,
                              collate_fn=getattr(dataset, "collate", None))  # (pairs: rows interleaved)
