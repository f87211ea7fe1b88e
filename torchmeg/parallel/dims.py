"""ParallelDims: parallel degrees -> one DeviceMesh with named dims.

Mesh dims, outermost first: pp, dp_replicate, dp_shard, cp, tp (tp innermost so its ranks are
neighbours — on a GPU node, the NVLink domain). Flattened views:
  dp          = dp_replicate x dp_shard      ranks that read different data
  dp_shard_cp = dp_shard x cp                what FSDP shards parameters over
  dp_cp       = dp_replicate x dp_shard x cp what the loss is averaged over
With expert parallel, a second mesh over the same ranks splits dp_shard x cp into (efsdp, ep).
"""
from __future__ import annotations

import warnings
from dataclasses import dataclass

from torch.distributed.device_mesh import init_device_mesh

from torchmeg.config.errors import ConfigError

NAMES = ("pp", "dp_replicate", "dp_shard", "cp", "tp")

# torch 2.13 announces a deprecation each time a flattened dim (dp, dp_cp, ...) is sliced from the
# root mesh, which every layout here does; harmless, and it would bury the log (and the one-line
# errors the CLIs promise).
warnings.filterwarnings("ignore", message=".*Slicing a flattened dim.*")


@dataclass(frozen=True)
class ParallelDims:
    dp_replicate: int
    dp_shard: int
    cp: int
    tp: int
    pp: int
    ep: int
    world_size: int
    # MoE under TP with sequence parallel: each TP rank routes its own sequence shard and the routed
    # experts are spread over the tp ranks (with EP: over ep x tp); set by validate for MoE models
    experts_over_tp: bool = False

    @classmethod
    def from_config(cls, cfg, world_size: int) -> "ParallelDims":
        p = cfg.parallelism
        fixed = p.data_parallel_replicate_degree * p.context_parallel_degree * p.tensor_parallel_degree \
            * p.pipeline_parallel_degree
        shard = p.data_parallel_shard_degree
        layout = (f"dp_replicate {p.data_parallel_replicate_degree} x dp_shard {{}} x cp {p.context_parallel_degree}"
                  f" x tp {p.tensor_parallel_degree} x pp {p.pipeline_parallel_degree}")
        if shard == -1:
            if world_size % fixed:
                raise ConfigError(f"parallelism: {layout.format('?')} = {fixed} does not divide the world size "
                                  f"{world_size}; launch a multiple of {fixed} processes or lower the degrees")
            shard = world_size // fixed
        if fixed * shard != world_size:
            raise ConfigError(f"parallelism: {layout.format(shard)} = {fixed * shard} but the world size is "
                              f"{world_size}; make the degrees multiply to {world_size} (or set "
                              f"data_parallel_shard_degree = -1) or launch {fixed * shard} processes")
        dims = cls(p.data_parallel_replicate_degree, shard, p.context_parallel_degree, p.tensor_parallel_degree,
                   p.pipeline_parallel_degree, p.expert_parallel_degree, world_size)
        return dims

    # ---- derived degrees ----
    @property
    def dp(self) -> int:
        return self.dp_replicate * self.dp_shard

    @property
    def fsdp(self) -> int:
        return self.dp_shard * self.cp

    def describe(self) -> str:
        parts = [f"{n}={getattr(self, n)}" for n in ("dp_replicate", "dp_shard", "cp", "tp", "pp", "ep") if getattr(self, n) > 1]
        return f"world {self.world_size}: " + (", ".join(parts) if parts else "single device")

    # ---- where the ranks are: torchrun numbers each node's ranks contiguously ----
    def strides(self) -> dict[str, int]:
        """Rank distance between neighbours along each mesh dim and flattened view (tp innermost)."""
        strides, s = {}, 1
        for name in ("tp", "cp", "dp_shard", "dp_replicate", "pp"):
            strides[name] = s
            s *= getattr(self, name)
        strides.update(dp_shard_cp=strides["cp"], dp_cp=strides["cp"], dp=strides["dp_shard"],
                       efsdp=strides["cp"], ep=strides["cp"])
        return strides

    @staticmethod
    def group_within_node(ranks: int, stride: int, ranks_per_node: int) -> bool:
        """Whether a group of `ranks` ranks `stride` apart lies inside one node (the fast links: NVLink
        on a GPU node). The run asks with torchrun's LOCAL_WORLD_SIZE, the planner with its GPU's
        node size: the same rule for both."""
        return ranks * stride <= ranks_per_node

    def node_split(self, ranks_per_node: int) -> str:
        """One line: which parallel dims stay inside a node and which cross nodes."""
        st, inside, across = self.strides(), [], []
        for name in ("tp", "cp", "dp_shard", "dp_replicate", "pp"):
            size = getattr(self, name)
            if size > 1:
                (inside if self.group_within_node(size, st[name], ranks_per_node) else across).append(f"{name} {size}")
        line = (f"within a node: {', '.join(inside) or 'nothing'}; across nodes: {', '.join(across) or 'nothing'}")
        if any(a.startswith(("tp", "cp")) for a in across):
            line += " (tp/cp across nodes put every layer's collectives on the network: keep them inside a node)"
        return line

    def uses_loss_parallel(self, p) -> bool:
        """Cross entropy on vocab-sharded logits (parallelism.loss_parallel under TP); under PP the
        last stage hands them to the schedule's loss sharded, as torchtitan does."""
        return self.tp > 1 and p.loss_parallel

    def check_tp(self, args, cfg) -> None:
        """Tensor (and sequence) parallel degrees against the model's sizes."""
        tp = self.tp
        if tp > 1:
            for what, n in (("model.n_heads", args.n_heads), ("model.n_kv_heads", args.kv_heads),
                            ("FFN hidden size", args.ffn_hidden), ("model.vocab_size", args.vocab_size)):
                if n % tp:
                    raise ConfigError(f"parallelism.tensor_parallel_degree = {tp}: does not divide {what} = {n}; "
                                      f"pick a degree that divides it")
            if cfg.parallelism.sequence_parallel and cfg.data.seq_len % tp:
                raise ConfigError(f"data.seq_len = {cfg.data.seq_len}: sequence parallel needs a multiple of "
                                  f"tensor_parallel_degree = {tp}")
            if cfg.parallelism.enable_async_tensor_parallel and not cfg.compile.enable:
                raise ConfigError("parallelism.enable_async_tensor_parallel = true: needs compile.enable = true "
                                  "(the overlap is an inductor pass)")
        elif cfg.parallelism.enable_async_tensor_parallel:
            raise ConfigError("parallelism.enable_async_tensor_parallel = true: needs tensor_parallel_degree > 1")

    def build_mesh(self, device_type: str):
        """The mesh over every rank, dims named as in NAMES, with the flattened views above."""
        mesh = init_device_mesh(device_type, (self.pp, self.dp_replicate, self.dp_shard, self.cp, self.tp),
                                mesh_dim_names=NAMES)
        mesh["dp_replicate", "dp_shard"]._flatten("dp")
        mesh["dp_shard", "cp"]._flatten("dp_shard_cp")
        mesh["dp_replicate", "dp_shard", "cp"]._flatten("dp_cp")
        return mesh

    @property
    def expert_dispatch_dim(self) -> str:
        """The ep mesh dim whose ranks exchange tokens and split the routed experts."""
        if self.experts_over_tp:
            return "ep_tp" if self.ep > 1 else "tp"
        return "ep"

    def build_ep_mesh(self, device_type: str):
        """Expert parallel: the same ranks with dp_shard x cp regrouped as (efsdp, ep), ep innermost
        (and ep x tp flattened as ep_tp when the experts also spread over tp); None when the routed
        experts are not distributed."""
        if self.ep == 1 and not self.experts_over_tp:
            return None
        mesh = init_device_mesh(device_type, (self.pp, self.dp_replicate, self.fsdp // self.ep, self.ep, self.tp),
                                mesh_dim_names=("pp", "dp_replicate", "efsdp", "ep", "tp"))
        if self.experts_over_tp and self.ep > 1:
            mesh["ep", "tp"]._flatten("ep_tp")
        return mesh
