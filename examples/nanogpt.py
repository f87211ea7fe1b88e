"""A nanoGPT-style model nobody wrote for torchmeg, trained through the public API.

    torchrun --nproc_per_node=2 examples/nanogpt.py                 # FSDP 2 + compile + full recompute
    torchrun --nproc_per_node=2 examples/nanogpt.py --no-compile    # the same without compile

The blocks live at `transformer.h` and the LM head is tied to the token embedding, as in nanoGPT;
parallelize() finds the blocks itself (the container holding the most parameters), wraps each in
FSDP, recompute and torch.compile, and reports what it did. Three AdamW steps run on every rank;
the same model is trained whole on one process alongside, and the largest loss difference is
printed (compiled kernels reorder float math: ~1e-6).
"""
import argparse
import copy
import gc
import math
import warnings

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

import torchmeg


class CausalSelfAttention(nn.Module):
    def __init__(self, dim, n_head):
        super().__init__()
        self.c_attn = nn.Linear(dim, 3 * dim)
        self.c_proj = nn.Linear(dim, dim)
        self.n_head = n_head

    def forward(self, x):
        B, T, C = x.shape
        q, k, v = self.c_attn(x).split(C, dim=2)
        q, k, v = (t.view(B, T, self.n_head, C // self.n_head).transpose(1, 2) for t in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.c_proj(y.transpose(1, 2).reshape(B, T, C))


class Block(nn.Module):
    def __init__(self, dim, n_head):
        super().__init__()
        self.ln_1, self.ln_2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.attn = CausalSelfAttention(dim, n_head)
        self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(approximate="tanh"), nn.Linear(4 * dim, dim))

    def forward(self, x):
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    def __init__(self, vocab=256, block_size=64, dim=64, n_layer=3, n_head=4):
        super().__init__()
        self.transformer = nn.ModuleDict(dict(
            wte=nn.Embedding(vocab, dim), wpe=nn.Embedding(block_size, dim),
            h=nn.ModuleList(Block(dim, n_head) for _ in range(n_layer)), ln_f=nn.LayerNorm(dim)))
        self.lm_head = nn.Linear(dim, vocab, bias=False)
        self.transformer.wte.weight = self.lm_head.weight  # weight tying
        for name, p in self.named_parameters():
            if name.endswith("c_proj.weight"):
                nn.init.normal_(p, 0.0, 0.02 / math.sqrt(2 * n_layer))

    def forward(self, idx):
        t = self.transformer
        x = t.wte(idx) + t.wpe(torch.arange(idx.shape[1], device=idx.device))
        for block in t.h:
            x = block(x)
        return self.lm_head(t.ln_f(x))


def loss_fn(model, tokens):
    return F.cross_entropy(model(tokens[:, :-1]).flatten(0, 1), tokens[:, 1:].flatten())


def main():
    warnings.filterwarnings("ignore")  # torch's mesh-slicing deprecation notices
    ap = argparse.ArgumentParser()
    ap.add_argument("--no-compile", action="store_true")
    a = ap.parse_args()
    dist.init_process_group("gloo")
    train(compile_blocks=not a.no_compile)
    gc.collect()  # the model's DTensors sit in reference cycles: freed while the interpreter is whole
    dist.barrier()
    dist.destroy_process_group()


def train(compile_blocks: bool) -> None:
    torch.manual_seed(0)
    model = GPT()
    reference = copy.deepcopy(model)

    cfg = torchmeg.Config()
    cfg.compile.enable = compile_blocks
    cfg.activation_checkpoint.mode = "full"
    dims = torchmeg.ParallelDims.from_config(cfg, dist.get_world_size())  # all ranks: FSDP
    mesh = dims.build_mesh("cpu")
    torchmeg.parallelize(model, dims, cfg, mesh=mesh)
    from torchmeg.parallel.parallelize import describe_report
    report = model.torchmeg_report

    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    ref_opt = torch.optim.AdamW(reference.parameters(), lr=1e-3)
    gen = torch.Generator().manual_seed(1)
    diff, r, dp = 0.0, mesh["dp"].get_local_rank(), dims.dp
    for _ in range(3):
        tokens = torch.randint(0, 256, (4, 33), generator=gen)
        loss = loss_fn(model, tokens.chunk(dp)[r])  # each rank its slice of the batch
        loss.backward()
        opt.step()
        opt.zero_grad()
        ref_loss = loss_fn(reference, tokens)
        ref_loss.backward()
        ref_opt.step()
        ref_opt.zero_grad()
        mean = loss.detach().clone()
        dist.all_reduce(mean)
        diff = max(diff, abs(mean.item() / dp - ref_loss.item()) / abs(ref_loss.item()))
    if dist.get_rank() == 0:
        print(f"parallelize: {describe_report(report)}")
        print(f"{dims.describe()}: blocks {report['blocks']}, FSDP units {report.get('fsdp_units')}, "
              f"compiled {report.get('compiled_blocks', 0)}, recompute {report.get('recompute_blocks', 0)}; "
              f"max relative loss diff vs one process over 3 steps = {diff:.2e}")


if __name__ == "__main__":
    main()
