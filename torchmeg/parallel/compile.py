"""torch.compile per transformer block, and on the loss.

Per block, not whole-model: one compiled graph is reused by every identical block (one compile,
not n_layers), graph breaks cannot spread across blocks, and FSDP's per-block hooks stay outside
the graphs.
"""
from __future__ import annotations

import hashlib
import os

import torch
from torch import nn
from torch._dynamo.eval_frame import _debug_get_cache_entry_list
from torch._dynamo.utils import counters
from torch.distributed import distributed_c10d as c10d  # (its registry of groups: name and members)

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
    torch.compiler.config.cache_key_tag = rank_cache_key_tag()
    torch._logging.set_logs(recompiles=True)


# The user's own tag (TORCH_COMPILE_CACHE_KEY_TAG), read once: setup() runs once per compiled part.
_USER_TAG = torch.compiler.config.cache_key_tag


def rank_cache_key_tag() -> str:
    """The tag torch adds to every compile cache key (`torch.compiler.config.cache_key_tag`): the
    user's own, plus, in a job of more than one rank, this rank and every process group it belongs
    to (name and members).

    Why: AOTAutograd's cache keys a graph by the dynamo graph and its inputs' metadata; a DTensor's
    part of that key is its mesh and placements (DeviceMesh._stable_hash: the whole mesh's rank map
    and layout), the same on every rank. What differs by rank comes in only when AOTAutograd traces
    the DTensor into local ops: this rank's mesh coordinate (a vocab shard's offset under
    loss_parallel, a TP embedding's mask) and the process group each collective names. So, on one
    cache folder, a rank's second run loads whichever rank's program was written last: TP 2 trained
    from a loss of 12.47 where the cold run had 6.08, and TP 2 x FSDP 2 stopped with 'Could not
    resolve the process group registered under the name 16' (torch 2.13.0; docs/limits.md has the
    14-line reproduction without torchmeg; pytorch/pytorch#188390, whose fix keys the local tensor's
    device, which on a CPU, or on two nodes' cuda:0, is the same on every rank). Inductor's own FX
    graph cache keys the traced graph, where both are written, and was never wrong.

    With this tag each rank keeps and finds its own entries (a second run of the same layout is as
    warm as before; ranks no longer share entries, which a cold start compiled on each rank anyway),
    and a program whose process groups are numbered otherwise (another layout, a job that made its
    groups in another order) misses rather than naming another rank's groups."""
    if not (torch.distributed.is_available() and torch.distributed.is_initialized()) \
            or torch.distributed.get_world_size() == 1 or os.environ.get("TORCHMEG_TEST_SHARED_CACHE_KEYS"):
        return _USER_TAG  # (the test hook: torch's own keys, to show compile.verify_cache catching them)
    rank = torch.distributed.get_rank()
    groups = sorted((name, tuple(sorted(c10d._world.pg_group_ranks.get(pg, {}))))
                    for pg, name in c10d._world.pg_names.items())
    digest = hashlib.blake2b(repr(groups).encode(), digest_size=8).hexdigest()
    tag = f"rank{rank}of{torch.distributed.get_world_size()}-groups-{digest}"
    return f"{_USER_TAG}-{tag}" if _USER_TAG else tag


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
