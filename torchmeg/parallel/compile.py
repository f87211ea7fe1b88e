"""torch.compile per transformer block, and on the loss.

Per block, not whole-model: one compiled graph is reused by every identical block (one compile,
not n_layers), graph breaks cannot spread across blocks, and FSDP's per-block hooks stay outside
the graphs.
"""
from __future__ import annotations

import os

import torch
from torch import nn
from torch._dynamo.eval_frame import _debug_get_cache_entry_list
from torch._dynamo.utils import counters

from torchmeg.models.blocks import blocks
from torchmeg.models.moe import is_grouped_experts


def setup(cache_dir: str = "") -> None:
    """Where inductor keeps compiled kernels (a warm cache turns a ~17 s cold compile of a small
    block into ~3 s), and recompiles reported with their reason (each is a silent slowdown).

    The cache is kept per CPU instruction set: torch 2.13's inductor cache does not key on the
    ISA ATen runs with, and a cache written under the native ISA, read by a process under
    ATEN_CPU_CAPABILITY=avx2, trains NaN from step 1 (measured: every loss NaN on the debug model;
    correct with a cache of its own)."""
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = isa_cache_dir(cache_dir or os.environ.get("TORCHINDUCTOR_CACHE_DIR", ""))
    torch._logging.set_logs(recompiles=True)


def isa_cache_dir(base: str) -> str:
    """`base` (default: inductor's own) with this process's ISA folder under it, once."""
    from torch._inductor.runtime.cache_dir_utils import default_cache_dir  # (lazy: inductor's import is ~1 s)
    base = os.path.abspath(base) if base else default_cache_dir()
    tag = isa_tag()
    return base if os.path.basename(base) == tag else os.path.join(base, tag)  # setup() runs once per stage


def isa_tag() -> str:
    """The instruction sets this process computes with: ATen's CPU capability, oneDNN's cap."""
    tag = f"isa-{torch.backends.cpu.get_cpu_capability()}"
    onednn = os.environ.get("ONEDNN_MAX_CPU_ISA") or os.environ.get("DNNL_MAX_CPU_ISA")
    return f"{tag}-onednn-{onednn}" if onednn else tag


def compile_blocks(model: nn.Module, tp: bool = False, cp: bool = False, blocks_path: str = "",
                   documents: bool = False) -> int:
    """Compile every block in place; returns how many. No blocks is an error: compiling nothing
    while compile.enable = true would be a silent no-op."""
    found = blocks(model, blocks_path)
    if not found:
        raise ValueError("compile.enable = true: no blocks found to compile (no ModuleList / ModuleDict / "
                         "Sequential of layers in the model); name them with model.blocks / parallelize(blocks=...)")
    for block in found:
        # In place (nn.Module.compile): parameter names stay as the model wrote them. Dropless MoE
        # routing sizes each expert's slice from the data, context-parallel attention talks to its
        # peers and document masking cuts attention where the data's documents end (all graph
        # breaks), so those blocks compile in pieces; every other block must compile whole.
        moe = any(is_grouped_experts(m) for m in block.modules())
        block.compile(fullgraph=not (moe or cp or documents))
    if tp and getattr(model, "tok_embeddings", None) is not None:
        # A compiled TP block fed straight from the TP embedding fails in backward
        # ('Tensor' object has no attribute '_local_tensor'); a clone of the embedding output
        # gives the graph an ordinary input (measured, torch 2.13).
        model.tok_embeddings.register_forward_hook(lambda m, i, out: out.clone())
    return len(found)


def compile_loss(fn, cache_dir: str = ""):
    setup(cache_dir)
    return torch.compile(fn)


def compile_summary(parts: list[nn.Module], blocks_path: str = "") -> str:
    """What the compiler really did in this process, from dynamo's and inductor's own records: the
    graphs dynamo holds for the blocks' forward code (a block compile that silently did nothing --
    a wrapper never called, a frame skipped -- holds none, even where the loss compiled), and the
    counters of every graph dynamo and inductor made."""
    codes = {type(b).forward.__code__ for part in parts for b in blocks(part, blocks_path)}
    block_graphs = sum(len(_debug_get_cache_entry_list(c)) for c in codes)
    graphs = counters["stats"]["unique_graphs"]
    inductor = counters["inductor"]["fxgraph_cache_miss"] + counters["inductor"]["fxgraph_cache_hit"]
    cached = counters["inductor"]["fxgraph_cache_hit"] + counters["aot_autograd"]["autograd_cache_hit"]
    breaks = sum(counters["graph_break"].values())
    return (f"[compile] blocks' forward: {block_graphs} graphs; dynamo graphs {graphs}, inductor graphs {inductor} "
            f"(forward and backward; "
            f"{cached} from the cache), graph breaks {breaks}")
