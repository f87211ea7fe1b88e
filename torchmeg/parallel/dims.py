"""ParallelDims: parallel degrees -> one DeviceMesh with named dims.

Mesh dims, outermost first: pp, dp_replicate, dp_shard, cp, tp (tp innermost so its ranks are
neighbours — on a GPU node, the NVLink domain). Flattened views:
  dp          = dp_replicate x dp_shard      ranks that read different data
  dp_shard_cp = dp_shard x cp                what FSDP shards parameters over
  dp_cp       = dp_replicate x dp_shard x cp what the loss is averaged over
With expert parallel, a second mesh over the same ranks splits dp_shard x cp into (efsdp, ep).
"""
from __future__ import annotations

from dataclasses import dataclass

NAMES = ("pp", "dp_replicate", "dp_shard", "cp", "tp")


@dataclass
class ParallelDims:
    dp_replicate: int
    dp_shard: int
    cp: int
    tp: int
    pp: int
    ep: int
    world_size: int

    @classmethod
    def from_config(cls, cfg, world_size: int) -> "ParallelDims":
        from torchmeg.config import ConfigError
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

    def check_model(self, args, cfg) -> None:
        """Degrees that must divide model sizes."""
        from torchmeg.config import ConfigError
        if self.pp > 1:
            from torchmeg.parallel.pipeline import check
            check(cfg, args, self.pp)
        if self.cp > 1:
            from torchmeg.parallel.context import check as check_cp
            check_cp(cfg, args, self)
        if self.ep > 1:
            from torchmeg.parallel.expert import check as check_ep
            check_ep(cfg, args, self)
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
        from torch.distributed.device_mesh import init_device_mesh
        mesh = init_device_mesh(device_type, (self.pp, self.dp_replicate, self.dp_shard, self.cp, self.tp),
                                mesh_dim_names=NAMES)
        mesh["dp_replicate", "dp_shard"]._flatten("dp")
        mesh["dp_shard", "cp"]._flatten("dp_shard_cp")
        mesh["dp_replicate", "dp_shard", "cp"]._flatten("dp_cp")
        self.ep_mesh = None
        if self.ep > 1:
            # The same ranks with dp_shard x cp regrouped as (efsdp, ep), ep innermost.
            self.ep_mesh = init_device_mesh(
                device_type, (self.pp, self.dp_replicate, self.fsdp // self.ep, self.ep, self.tp),
                mesh_dim_names=("pp", "dp_replicate", "efsdp", "ep", "tp"))
        return mesh
