"""A static decode step (vLLM's compiled, CUDA-graphed decode): one compiled forward for every decode
step of the serving engine, replayed as a CUDA graph on a GPU.

An eager decode step dispatches ~35-40 ops a layer from Python, each a kernel launch on a GPU: a 1B's
step on an H200 took 24,001 launches and was bound by the host (docs/gpu-results.md). Here the step is
one `torch.compile`d function of fixed inputs, so inductor fuses the pointwise ops (the norms, RoPE, the
residuals, the cache writes' index math) and a GPU replays the whole step as one CUDA graph:

- **Inputs, one upload**: [2 + blocks, rows] int64, by column: each row's start (the position its new
  token takes), its token and its block table padded with the null block (column-major so the starts
  are the buffer's first row: FlexAttention's mask reads them from the input itself). Positions, the
  pool slot each new key is written at, the slots each row reads and its mask are computed inside the graph.
- **Padded to a few sizes** (`capture_sizes`, vLLM's: 1, 2, 4, then multiples of 8 up to --max-seqs):
  the rows past the batch read and write only the null block (start 0, every table entry the null
  block) and their logits are dropped. The tables' width is the batch's longest in blocks; on a GPU
  rounded up to a power of two, so a size has a handful of widths, each its own graph.
- **Compiled once, shapes symbolic**: the batch is unbacked on a CPU (a batch of 1 gets no graph of
  its own; on a GPU backed, as vLLM marks it: 1 and the rest) and the width dynamic, so one compile
  (two on a GPU) serves every size and length (`compiles` counts them: tests/test_serve_static.py). On a GPU each size and width is recorded as a CUDA graph the first time
  it runs and replayed after (inductor's cudagraph trees); the pools are marked static (the graphs
  write them in place). On a CPU the kernels are called from C++ (inductor's cpp_wrapper).
- **Attention**: on a CPU our paged decode kernel over the pools themselves (batching.cpu_attention:
  each row's query against its own positions through its table; built at the first CPU engine), or
  where it cannot be built FlexAttention over the pools (inductor's C++ template: one block mask a
  step, each row's table its blocks, the last one masked past the row's start; the rows the queries of
  one sequence, each its own query block): either way a row reads only its own blocks and nothing is
  copied. Elsewhere SDPA over the view gathered through the block tables (as the eager
  decode's batching.paged), masked past each row's start (FlexAttention's GPU kernel under CUDA graphs
  not yet measured here). q, k and v as one matmul (`StackedQKV`: a copy of the three weights stacked,
  kept in step with them). RoPE in its real form (models.rope.REAL_FORM, set around the step: one
  fused kernel; inductor has no code for the complex multiply every other forward runs).
- **Guards**: every call checks the inputs' and the pools' shapes and types, not the model's
  parameters (torch.compiler.skip_guard_on_all_nn_modules_unsafe: their checks took a quarter of a
  16-layer CPU step). One compile per model (`isolate_recompiles`: another model never runs its
  graph), shared by every engine over that model: a server's, each benchmark run's.

Prefill stays eager (batching.runner): prompts vary in length and are compute-bound. Serving turns the
step on with `--static-decode on` (default `auto`: on with CUDA, where the graphs pay; a CPU pays a
compile at the first decode, ~20 s for a small model, and the attention kernel's build once per
machine, ~10-25 s) and off with `--enforce-eager` (vLLM's flag).
Eligible: torchmeg's own model families on one rank (`eligible`); `hf` models, whose attention runs
through transformers' interface, and tensor-parallel engines keep the eager step. The step compiles as
one graph (fullgraph); one that does not (the MoE families: their experts run under
torch._dynamo.disable) turns the static step off with one warning naming the error (the eager step
runs it; the runner's `static_failed` says why), for this engine and every later one over the model.
"""
from __future__ import annotations

import weakref
from collections import Counter

import torch

from torchmeg.batching import cpu_attention
from torchmeg.batching.blocks import BLOCK, NULL
from torchmeg.batching.paged import PagedCache
from torchmeg.models.kv_cache import LayerCache
from torchmeg.models.rope import REAL_FORM


def capture_sizes(max_seqs: int) -> list[int]:
    """The batch sizes a decode step is padded to (vLLM's cudagraph capture sizes: 1, 2, 4, then
    every multiple of 8), up to the first that holds `max_seqs`."""
    sizes, s = [], 1
    while not sizes or sizes[-1] < max_seqs:
        sizes.append(s)
        s = s * 2 if s < 8 else s + 8
    return sizes


def eligible(model) -> str:
    """'' when a model's decode can run as a static step, else why not (one phrase)."""
    if hasattr(model, "keeps_own_cache"):  # (models.hf_causal's, whichever cache it keeps)
        return "an hf model's attention runs through transformers"
    if any(type(p).__name__ == "DTensor" for p in model.parameters()):
        return "tensor parallel"
    failed = _COMPILED.get(model, {}).get("failed")
    return f"its step did not compile ({failed})" if failed else ""


def did_not_compile(model, why: str) -> None:
    """Remember that `model`'s step failed to compile (its next engines keep the eager step at once)."""
    _COMPILED.setdefault(model, {})["failed"] = why


class StaticDecode:
    """The compiled decode step of one engine's model over its paged cache (batching.paged)."""

    def __init__(self, model, cache: PagedCache, max_seqs: int, graphs: bool):
        self.model, self.cache, self.graphs = model, cache, graphs
        self.sizes = capture_sizes(max_seqs)
        self.steps: Counter = Counter()  # decode steps run, by padded size
        # a CPU's attention: the paged kernel (built at the first CPU engine), else FlexAttention
        self.view = StaticCache(cache, paged_kernel=cache.device.type == "cpu" and cpu_attention.load())
        self.qkv = StackedQKV.of(model)
        self._fn, self._compiled = compiled_step(model, graphs)

    @property
    def compiles(self) -> int:
        """Graphs compiled for this model so far (every engine over it shares them)."""
        return self._compiled[0]

    @property
    def graph_ops(self) -> Counter:
        """The calls in the last graph compiled, by function name (dynamo's graph, before inductor):
        what the step runs (its matmuls, its attention kernel), for tests/test_serve_static.py."""
        return self._compiled[1]

    def width(self, blocks: int) -> int:
        """The block tables' width for a batch whose longest reads `blocks` blocks: on a GPU the next
        power of two (a graph per width), on a CPU the blocks themselves (no graphs; no padding read)."""
        return 1 << (blocks - 1).bit_length() if self.graphs else blocks

    def size(self, rows: int) -> int:
        return next(s for s in self.sizes if s >= rows)

    def run(self, tables: list[list[int]], starts: list[int], tokens: list[int]) -> torch.Tensor:
        """One decode step: row i's token at position starts[i], its keys through tables[i] ->
        logits [rows, V] (the padded rows' dropped)."""
        rows, dev = len(tables), self.cache.device
        size = self.size(rows)
        # (2 blocks at least: a table of 1 is a specialized shape, its own graph)
        blocks = self.width(max(2, *(s // BLOCK + 1 for s in starts)))
        pad = size - rows
        host = [list(starts) + [0] * pad, list(tokens) + [0] * pad]
        host += [[tb[j] if j < len(tb) else NULL for tb in tables] + [NULL] * pad for j in range(blocks)]
        packed = torch.tensor(host, dtype=torch.long, device=dev)
        # the tables' width dynamic; the batch too: on a CPU unbacked (a batch of 1 gets no graph of its
        # own), on a GPU backed (as vLLM marks it: cudagraph trees' well-trodden path; 1 and the rest)
        if self.graphs:
            torch._dynamo.maybe_mark_dynamic(packed, 1)
        else:
            torch._dynamo.decorators.mark_unbacked(packed, 1)
        torch._dynamo.maybe_mark_dynamic(packed, 0)
        self.view.sync()
        for name, w in self.qkv.current().items():
            self.view.layers[name].qkv = w
        if self.graphs and not self.view.marked:
            self.view.mark_static()
            for w in self.qkv.stacks.values():  # (kept at one address, refreshed in place: as the pools)
                torch._dynamo.mark_static_address(w)
        # (no_grad: the graph is inference's, a caller's grad mode would compile another; RoPE's real form)
        REAL_FORM[0] = True
        try:
            with torch.no_grad():
                out = self._fn(self.model, self.view, packed)[:rows]
        finally:
            REAL_FORM[0] = False
        self.steps[size] += 1
        self.cache.written += rows
        return out


class StackedQKV:
    """Each attention's q, k and v weights stacked into one [(H + 2K) x D, dim] copy, so the static
    step runs one matmul where eager runs three (models.llama.Attention.project reads it from the
    layer's cache; vLLM's models hold q/k/v fused, ours keep Hugging Face's three for training, tensor
    parallelism and checkpoints). A copy, the size of the three weights (with GQA ~1.5x the query's;
    not the feed-forward's w1/w3, which would cost ~40% of a Llama's weights more), kept in step with
    the model: before each step every source weight's version counter and storage are compared with
    those it was copied from, and a layer's stack is copied again if one changed (an optimizer's step,
    load_state_dict, .to()), in place: one set of stacks per model (`of`, kept beside its compiled
    step), shared by every engine over it as the compiled step is, at fixed addresses (a CUDA graph
    reads them where they were recorded; a new tensor would be a new graph input). A new dtype or
    device makes a new tensor (a new graph then)."""

    @classmethod
    def of(cls, model) -> "StackedQKV":
        """The model's stacks (made at its first static engine; kept with its compiled step)."""
        per_model = _COMPILED.setdefault(model, {})
        if "qkv" not in per_model:
            per_model["qkv"] = cls(model)
        return per_model["qkv"]

    def __init__(self, model):
        self.sources = {}
        for name, layer in getattr(model, "layers", {}).items():
            attn = getattr(layer, "attention", None)
            linears = [getattr(attn, n, None) for n in ("wq", "wk", "wv")]
            if getattr(attn, "stacks_qkv", False) and all(_plain(m) for m in linears):
                self.sources[name] = tuple(linears)
        self.stacks: dict[str, torch.Tensor] = {}
        self.stamps: dict[str, tuple] = {}

    def current(self) -> dict[str, torch.Tensor]:
        """Layer name -> its stacked weight, made again where a source changed since."""
        for name, linears in self.sources.items():
            stamp = tuple((m.weight._version, m.weight.data_ptr()) for m in linears)
            if self.stamps.get(name) != stamp:
                ws = [m.weight.detach() for m in linears]
                shape = (sum(w.shape[0] for w in ws), ws[0].shape[1])
                kept = self.stacks.get(name)
                with torch.no_grad():
                    if kept is not None and (tuple(kept.shape), kept.dtype, kept.device) == (shape, ws[0].dtype, ws[0].device):
                        torch.cat(ws, out=kept)  # (in place, no temporary: the same address)
                    else:
                        self.stacks[name] = torch.cat(ws)
                self.stamps[name] = stamp
        return self.stacks


def _plain(m) -> bool:
    """A bias-free nn.Linear whose forward is its matmul alone: no hook (a LoRA adapter adds its update
    in one, models.lora) and no subclass (float8's, a quantized one), so the stacked matmul equals it."""
    return (type(m) is torch.nn.Linear and m.bias is None and not m._forward_hooks and not m._forward_pre_hooks
            and not torch.nn.modules.module._global_forward_hooks and not torch.nn.modules.module._global_forward_pre_hooks)


_COMPILED: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


def compiled_step(model, graphs: bool):
    """The compiled `decode_step` for `model` -> (callable, [compiles]): one per model (its own
    entries: isolate_recompiles), shared by every engine over it (a server's, each GRPO rollout's, each
    of a benchmark's runs), which differ only in their pools (guarded: shapes and types)."""
    key = (graphs,)
    per_model = _COMPILED.setdefault(model, {})
    if key not in per_model:
        count = [0, Counter()]

        def backend(gm, example_inputs):
            from torch._inductor.compile_fx import compile_fx  # lazy: inductor loads at the first compile
            count[0] += 1
            count[1] = Counter(getattr(n.target, "__name__", str(n.target)) for n in gm.graph.nodes if n.op == "call_function")
            # a GPU replays the step as CUDA graphs; a CPU calls its kernels from C++ (inductor's
            # cpp_wrapper: the Python wrapper's ~25 views and checks a layer took half a 16-layer step)
            return compile_fx(gm, example_inputs, config_patches={"triton.cudagraphs": graphs, "cpp_wrapper": not graphs})
        # fullgraph: one frame, whose module guards can be skipped. With a graph break (MoE's routing)
        # each layer's resumed frame would be compiled once and, unguarded, run for another layer of
        # another kind (a dense block's for an MoE block's; gpt-oss's windowed layer's for a full one's):
        # such a model fails to compile here and keeps the eager step (batching.runner)
        fn = torch.compile(decode_step, backend=backend, dynamic=None, fullgraph=True, isolate_recompiles=True,
                           options={"guard_filter_fn": torch.compiler.skip_guard_on_all_nn_modules_unsafe})
        per_model[key] = (fn, count)
    return per_model[key]


def decode_step(model, view: "StaticCache", packed: torch.Tensor) -> torch.Tensor:
    """The step compiled: packed [2 + blocks, rows] (starts, tokens, tables by column) -> logits [rows, V]."""
    start, tokens, tables = packed[0], packed[1][:, None], packed[2:].T
    positions = start[:, None]
    view.bind(positions, tables, packed)
    logits = model(tokens, positions=positions, cache=view)[:, -1]
    view.bind(None, None)  # (nothing of the step outlives it: no tensor stored for dynamo to return)
    return logits


class StaticCache:
    """The cache interface the model code calls (models.kv_cache: layer(name), mask, query_slots),
    over a PagedCache's pools, its per-step tensors bound inside the compiled step."""

    def __init__(self, paged: PagedCache, paged_kernel: bool = False):
        self.paged = paged
        self.layers: dict[str, StaticLayer] = {}
        self.model_state: dict = {}
        self.marked = False
        # a decode's attention: "paged" (batching.cpu_attention's kernel), "flex" (a CPU without it), "sdpa"
        self.kernel = "paged" if paged_kernel else "flex" if paged.device.type == "cpu" else "sdpa"

    def layer(self, name: str) -> "StaticLayer":
        return self.layers[name]

    def sync(self) -> None:
        """Every layer's pools, before a step (outside the graph: the dict it reads stays the same)."""
        if len(self.layers) != len(self.paged.layers):
            self.layers = {n: StaticLayer(self, x) for n, x in self.paged.layers.items()}

    def mark_static(self) -> None:
        """The pools as fixed addresses (a CUDA graph writes them in place)."""
        for layer in self.paged.layers.values():
            for pool in (layer.k, layer.v):
                if pool is not None:
                    torch._dynamo.mark_static_address(pool)
        self.marked = True

    def bind(self, positions: torch.Tensor, tables: torch.Tensor, packed: torch.Tensor | None = None) -> None:
        """positions [rows, 1], tables [rows, blocks]: the slots each row reads (every position of its
        blocks, in order), the one it writes, and which it may read (<= its position); None: unbound."""
        if tables is None:
            self.read = self.write = self.write_at = self._mask = self.tables = self.packed = self._blocks = None
            return
        self.tables, self.packed, self._blocks = tables, packed, None
        every = (tables[:, :, None] * BLOCK + torch.arange(BLOCK, device=tables.device)).flatten(1)
        self.read, self.write_at = every, positions
        self.write = every.gather(1, positions).flatten()
        j = torch.arange(every.shape[1], device=tables.device)
        self._mask = (j[None, None, :] <= positions[:, :, None])[:, None]  # [rows, 1, 1, keys]

    def mask(self, n: int, keys: int) -> torch.Tensor:
        return self._mask

    def block_mask(self, slots: int):
        """FlexAttention's block mask over a pool of `slots` positions, built once a step (every layer
        reads through the same tables): row r's full blocks are its table's first start // BLOCK, its
        last block partial (positions up to start % BLOCK). Its CPU kernel asks the partial blocks'
        indices to span the pool's blocks: a stride-0 view of each row's last block (only the first read)."""
        if self._blocks is None:
            from torch.nn.attention.flex_attention import BlockMask  # lazy: the static step's trace only
            tables, packed, start = self.tables, self.packed, self.write_at[:, 0]
            rows, width = tables.shape
            n = start // BLOCK + 1
            full = tables.to(torch.int32)
            # (the partial block's index, stretched to the pool's width as a view: only the first is read)
            last = full.gather(1, (n - 1)[:, None]).expand(rows, slots // BLOCK)

            def last_block(b, h, q, kv):  # (q: a row; kv: a pool position. The step's input itself, not
                return kv % BLOCK <= packed[0, q] % BLOCK  # a view of it: inductor's CPU template takes buffers)
            self._blocks = BlockMask.from_kv_blocks(
                torch.ones(1, 1, rows, dtype=torch.int32, device=tables.device), last[None, None],
                (n - 1).to(torch.int32)[None, None], full[None, None], BLOCK_SIZE=(1, BLOCK),
                mask_mod=last_block, seq_lengths=(rows, slots), compute_q_blocks=False)  # (no backward)
        return self._blocks

    def query_slots(self, n: int) -> torch.Tensor:
        """[rows, 1]: each new token's index among the keys a layer reads (its position)."""
        return self.write_at


class StaticLayer(LayerCache):
    """One layer's pools (batching.paged.PagedLayer's), written and read through the bound tables."""

    def __init__(self, owner: StaticCache, paged_layer):
        super().__init__(owner)
        self.paged_layer = paged_layer
        self.qkv = None  # (StackedQKV's, set before each step)

    def _store(self, name: str, x_BKLD: torch.Tensor) -> torch.Tensor:
        """Write the new keys (or values) at their slots -> the pool [K, positions, D]."""
        c, pool = self.owner, getattr(self.paged_layer, name)
        K, _, D = pool.shape
        pool.index_copy_(1, c.write, x_BKLD.transpose(0, 1).reshape(K, -1, D).to(pool.dtype))
        return pool

    def _write(self, name: str, x_BKLD: torch.Tensor) -> torch.Tensor:
        c, pool = self.owner, self._store(name, x_BKLD)
        K, _, D = pool.shape
        R, L = c.read.shape
        return pool.index_select(1, c.read.flatten()).view(K, R, L, D).transpose(0, 1)

    def attend(self, q_BHLD: torch.Tensor, k_BKLD: torch.Tensor, v_BKLD: torch.Tensor) -> torch.Tensor:
        """On a CPU the paged kernel (batching.cpu_attention), else FlexAttention, over the pools
        themselves, each row only its own blocks (no gathered copy, no padding read); elsewhere, or a
        pool of another dtype, SDPA over the gathered view."""
        c = self.owner
        if c.kernel == "sdpa" or q_BHLD.dtype != self.paged_layer.k.dtype:
            return super().attend(q_BHLD, k_BKLD, v_BKLD)
        pk, pv = self._store("k", k_BKLD), self._store("v", v_BKLD)
        if c.kernel == "paged":  # (one query a row: [rows, H, 1, D])
            return cpu_attention.paged_decode_attention(q_BHLD[:, :, 0], pk, pv, c.tables, c.write_at[:, 0],
                                                        q_BHLD.shape[-1] ** -0.5, BLOCK)[:, :, None]
        from torch.nn.attention.flex_attention import flex_attention  # lazy: the static step's trace only
        # the rows as the queries of one sequence, each query its own block of the mask (a batch of rows
        # over a batch-1 pool is a broadcast that asks rows != 1, which an unbacked batch cannot answer);
        # the query scaled here, a buffer of its own (inductor's CPU template reads the query's 4 sizes
        # from the buffer under it, and RoPE's leaves a [.., D / 2, 2] one)
        q = (q_BHLD * q_BHLD.shape[-1] ** -0.5).transpose(0, 2)
        out = flex_attention(q, pk[None], pv[None], block_mask=c.block_mask(pk.shape[1]),
                             scale=1.0, enable_gqa=q_BHLD.shape[1] != pk.shape[0])
        return out.transpose(0, 2)
