"""The model runner: runs a step's plan (batching.scheduler.Plan) on the model and its paged KV
cache (batching.paged), through the block tables the plan carries.

Prompts that start this step run packed in one forward (batching.paged.bind_packed: one row, each
prompt attending to itself), the head on each prompt's last token only; chunks that continue a
sequence (the next chunk of a long prompt, the rest of a prompt after its cached prefix) run as rows
of one forward when they are as long, else alone, as does a prompt whose every position is scored
(echo); then every decoding sequence runs one token in one forward. Every tensor-parallel rank runs
the same plan (`follow`), so their pools hold the same positions in the same blocks.
"""
from __future__ import annotations

import inspect
import logging
from typing import Callable

import torch

from torchmeg.config.errors import ConfigError
from torchmeg.models.kv_cache import KVCache, varying_shapes
from torchmeg.batching.scheduler import Plan
from torchmeg.batching.paged import PagedCache
from torchmeg.batching.static_decode import StaticDecode, did_not_compile, eligible

log = logging.getLogger("torchmeg.serve")


class ModelRunner:
    def __init__(self, model, device, num_blocks: int, max_len: int, eos_id: int = 0, static_decode: bool = False,
                 max_seqs: int = 1):
        """`static_decode`: decode steps through one compiled step, a CUDA graph on a GPU
        (batching.static_decode); a model it does not serve keeps the eager step (`static_failed`: why)."""
        self.model, self.device, self.max_len = model, torch.device(device), max_len
        self.filler = max(eos_id, 0)
        self.cache = PagedCache(num_blocks, device)
        params = inspect.signature(model.forward).parameters
        self.last_only = "last_only" in params  # the head on chosen positions only (torchmeg's families)
        self.own_cache = bool(getattr(model, "keeps_own_cache", False))
        self.own: dict[int, KVCache] = {}  # slot -> its sequence's cache, when the model keeps its own
        self.full: dict[int, torch.Tensor] = {}  # slot -> its chunk's logits at every position [n, V]
        self.static: StaticDecode | None = None
        # why the static step asked for does not run (its compile failed, now or for an earlier engine)
        self.static_failed = eligible(model) if static_decode else ""
        if static_decode and not self.static_failed:
            self.static = StaticDecode(model, self.cache, max_seqs, graphs=self.device.type == "cuda")

    def forward(self, plan: Plan) -> torch.Tensor:
        """Run a plan's forwards -> logits [chunks + decodes, V], float: each prefill chunk's last
        position, then each decode row (every rank runs this). Attention in kernels that build nothing
        per shape (models.kv_cache.varying_shapes: each step's shapes are new)."""
        with varying_shapes():
            return self._forward(plan)

    def _forward(self, plan: Plan) -> torch.Tensor:
        self.full = {}
        if self.own_cache:
            return self._forward_each(plan)
        out: list[torch.Tensor | None] = [None] * len(plan.prefill)
        packed = [i for i, (slot, start, _) in enumerate(plan.prefill)
                  if start == 0 and slot not in plan.full and self.last_only]
        if packed:
            chunks = [plan.prefill[i] for i in packed]
            positions = self.cache.bind_packed([plan.tables[c[0]] for c in chunks], [len(c[2]) for c in chunks])
            tokens = torch.tensor([[t for c in chunks for t in c[2]]], dtype=torch.long, device=self.device)
            ends = torch.tensor([len(c[2]) for c in chunks], device=self.device).cumsum(0) - 1
            logits = self.model(tokens, positions=positions, cache=self.cache, last_only=ends)[0]
            for i, row in zip(packed, logits):
                out[i] = row
        # Chunks that continue a sequence (a long prompt's next chunk, a prompt after its cached prefix)
        # run together when they are as long: one forward, each attending to its own keys through its
        # table (a burst of prompts after one cached system prompt: one forward, not one each).
        groups: dict[int, list[int]] = {}
        for i, (slot, start, chunk) in enumerate(plan.prefill):
            if out[i] is None and slot not in plan.full:
                groups.setdefault(len(chunk), []).append(i)
        for n, idx in groups.items():
            if len(idx) > 1:
                positions = self.cache.bind([plan.tables[plan.prefill[i][0]] for i in idx],
                                            [plan.prefill[i][1] for i in idx], n, [plan.prefill[i][2] for i in idx])
                head = {"last_only": True} if self.last_only else {}
                logits = self.model(self.cache.tokens, positions=positions, cache=self.cache, **head)[:, -1]
                for i, row in zip(idx, logits):
                    out[i] = row
        for i, (slot, start, chunk) in enumerate(plan.prefill):
            if out[i] is None:
                positions = self.cache.bind([plan.tables[slot]], [start], len(chunk))
                out[i] = self._chunk(plan, slot, chunk, positions, self.cache)[0]
        rows = [o[None] for o in out]
        static = self._static(plan) if plan.rows and self.static is not None else None
        if static is not None:
            rows.append(static)
        elif plan.rows:  # (the tokens, starts and tables in one upload)
            positions = self.cache.bind([plan.tables[s] for s in plan.rows], plan.starts, 1, [[t] for t in plan.tokens])
            rows.append(self.model(self.cache.tokens, positions=positions, cache=self.cache)[:, -1])
        return torch.cat(rows).float() if rows else torch.empty(0)

    def _static(self, plan: Plan) -> torch.Tensor | None:
        """The decode rows through the static step -> logits, or None when its compile failed (the
        step turned off, one warning: the eager decode runs this step and the next)."""
        try:
            return self.static.run([plan.tables[s] for s in plan.rows], plan.starts, plan.tokens)
        except torch._dynamo.exc.TorchDynamoException as e:  # (a graph break under fullgraph, a failed compile)
            self.static_failed = str(e).splitlines()[0][:300]
            did_not_compile(self.model, self.static_failed)
            log.warning("the static decode step did not compile (%s): decoding eagerly; --enforce-eager skips it",
                        self.static_failed)
            self.static = None
            return None

    def _chunk(self, plan: Plan, slot: int, chunk: list[int], positions, cache) -> torch.Tensor:
        """One prompt chunk alone over `cache` -> its last position's logits [1, V]; every position's
        kept in `self.full` for a slot whose prompt is scored (echo)."""
        tokens = torch.tensor([chunk], dtype=torch.long, device=self.device)
        head = {"last_only": True} if self.last_only and slot not in plan.full else {}
        logits = self.model(tokens, positions=positions, cache=cache, **head)
        if slot in plan.full:
            self.full[slot] = logits[0]
        return logits[:, -1]

    def _forward_each(self, plan: Plan) -> torch.Tensor:
        """A model that keeps its own cache (transformers' attention, for `hf` models) cannot read the
        slots: each sequence runs alone over a cache of its own (models.kv_cache with one row), the
        same forwards torchmeg.generate runs for it. Sequences still join and leave at every step;
        only the forwards are not batched."""
        out = []
        for slot, start, chunk in plan.prefill:
            if start == 0:
                self.own[slot] = KVCache(1, self.max_len, device=self.device)
            cache = self.own[slot]
            out.append(self._chunk(plan, slot, chunk, cache.positions(len(chunk)), cache))
            cache.advance(len(chunk))
        for slot, token in zip(plan.rows, plan.tokens):
            cache = self.own[slot]
            tokens = torch.tensor([[token]], dtype=torch.long, device=self.device)
            out.append(self.model(tokens, positions=cache.positions(1), cache=cache)[:, -1])
            cache.advance(1)
        return torch.cat(out).float() if out else torch.empty(0)

    def reserve(self) -> int:
        """Allocate the KV pool now (a one-token prefill into the null block, every rank at once under
        TP): a pool that does not fit fails at start, not at the first request. -> its bytes."""
        try:
            with torch.no_grad():
                self.forward(Plan(prefill=[(0, 0, [self.filler])], tables={0: [0]}))
        except RuntimeError as e:  # torch.OutOfMemoryError on CUDA; the CPU allocator's "can't allocate"
            if not isinstance(e, torch.OutOfMemoryError) and "allocate" not in str(e):
                raise
            raise ConfigError(f"a KV pool of {self.cache.num_blocks} blocks does not fit "
                              f"({str(e).splitlines()[0]}); lower --kv-cache-gib") from None
        self.cache.written = 0  # (the null block's: no sequence's)
        return self.cache.pool_bytes()


def kv_bytes_per_token(model, device) -> int:
    """KV cache bytes one position takes on this rank (every layer, keys and values; 0 for a model
    that keeps its own cache): a pool of one block, reserved, over its positions."""
    runner = ModelRunner(model, device, 1, 1)
    return runner.reserve() // runner.cache.block_size


def follow(runner: ModelRunner, receive: Callable[[], Plan]) -> None:
    """A TP rank other than 0: run the forwards rank 0 plans until it says stop."""
    with torch.no_grad():
        while True:
            plan = receive()
            if plan.stop:
                return
            if plan.runs():
                runner.forward(plan)
