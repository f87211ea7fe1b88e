"""The run header rank 0 prints before step 1: what runs, on what, from where, at what peak."""
from __future__ import annotations

import os
import re

import torch
import torch.distributed as dist

from torchmeg import __version__
from torchmeg.runtime import process as runtime
from torchmeg.kernels.fused_ce import chunk_rows
from torchmeg.models.count import active_params, count_params
from torchmeg.models.lora import adapters, scaling as lora_scaling
from torchmeg.config.checks import decay_steps


def header_lines(tr) -> list[str]:
    """The run header rank 0 prints before step 1."""
    c, d, layout, whole = tr.cfg, tr.dims, tr.layout, tr.built.whole
    a = layout.args
    n, dense, active = count_params(whole), count_params(whole, exclude_embeddings=True), active_params(whole)
    if layout.spec.make_args is not None:  # e.g. hf/llama (LlamaForCausalLM from recipes/hf/x.json)
        name = f"{c.model.name}/{a.model_type} ({getattr(whole, 'hf_class', type(whole).__name__)} from {c.model.hf_config})"
    else:
        name = f"{c.model.name}/{c.model.flavor}"
    unit = "pairs" if layout.rows_per_sample == 2 else "seq"
    if c.training.objective == "grpo":
        g = c.grpo
        data_line = (f"data       {c.data.dataset} ({tr.tokenizer.name} tokenizer"
                     + (f", chat template {tr.template.name}" if tr.template is not None else "")
                     + f"): {len(tr.train_set):,} prompts, {layout.global_batch // g.num_generations} a step x "
                     f"{g.num_generations} completions of up to {g.max_completion_length} tokens (temperature "
                     f"{g.temperature:g}, top-p {g.top_p:g}) by the serving engine on the live weights; rewards "
                     f"{', '.join(g.reward_funcs)}" + (f" x {list(g.reward_weights)}" if g.reward_weights else "")
                     + f"; {tr.loader.note}")
    elif c.training.objective == "dpo":
        data_line = (f"data       {c.data.dataset} ({tr.tokenizer.name} tokenizer): {tr.train_set.describe()}; "
                     f"validation {'on' if c.validation.enable else 'off'}; {tr.dpo_note}")
    elif c.training.objective == "sft":
        data_line = (f"data       {c.data.dataset} ({tr.tokenizer.name} tokenizer, chat template "
                     f"{tr.train_set.template_name}): {tr.train_set.windows.describe()}; validation "
                     f"{'on' if c.validation.enable else 'off'}")
    else:
        src = tr.train_set.src
        n_tok = sum(len(p.w) for p in (src.sources if hasattr(src, "sources") else [src])) * c.data.seq_len
        data_line = (f"data       {c.data.dataset} ({tr.tokenizer.name} tokenizer): {n_tok / 1e6:.1f}M train tokens, "
                     f"{tr.train_set.n_unique:,} windows; validation {'on' if c.validation.enable else 'off'}")
    return [
        f"torchmeg {__version__} | torch {torch.__version__} | run '{c.job.name}' -> {c.run_dir}",
        f"model      {name}: {n / 1e6:.2f}M params ({dense / 1e6:.2f}M non-embedding"
        + (f", {active / 1e6:.2f}M active per token" if active != n else "")
        + f"), {a.n_layers} layers, dim {a.dim}, heads {a.n_heads}/{a.kv_heads}, vocab {a.vocab_size}; "
        f"{tr.flops_per_token / 1e6:.1f} MFLOP/token at seq {c.data.seq_len}",
        data_line,
        f"layout     {d.describe()} | {tr.device.type} ({dist.get_backend()}) | {c.training.mixed_precision}"
        + (" (TF32 matmuls)" if tr.device.type == "cuda" and c.training.tf32 and c.training.mixed_precision == "fp32" else "")
        + (" | glibc keeps freed memory" if runtime.FREED_MEMORY_KEPT else "")
        + (f" | {tr.built.stage_desc}" if tr.built.schedule is not None else ""),
        *_node_lines(d),
        f"parallel   {tr.built.report}",
        *_compile_lines(c),
        *_lora_lines(c, whole, n),
        f"init       {tr.init_note}",
        f"batch      {layout.local_batch} {unit} x dp {d.dp} x accum {layout.accum} = {layout.global_batch} "
        f"{unit} = {layout.tokens_per_step:,} tokens/step, {c.training.steps} steps",
        f"optimizer  {c.optimizer.name} lr {c.optimizer.lr:g}"
        + (f" (matrices {c.optimizer.muon_lr or c.optimizer.lr:g}, {c.optimizer.muon_adjust_lr})"
           if c.optimizer.name == "muon" else "")
        + f": {tr.optimizer_groups}; {_schedule(c)}; clip {c.training.max_norm:g}",
        f"loss       {_loss_line(c, tr.built, layout)}",
        f"peak       {tr.peak / 1e12:.3f} TFLOP/s per rank ({tr.peak_source})",
    ]


def _compile_lines(cfg) -> list[str]:
    """Where compiled programs come from: the caches torch reads (on, off, where) and the key tag
    that keeps each rank's entries apart (torchmeg.parallel.compile.rank_cache_key_tag)."""
    if not cfg.compile.enable:
        return []
    from torch._functorch import config as aot_config  # (lazy: inductor's import is ~1 s; only compiled runs)
    from torch._inductor import config as inductor_config  # (lazy: as above)
    on = lambda flag: "on" if flag else "off"  # noqa: E731
    tag = torch.compiler.config.cache_key_tag
    return [f"compile    {', '.join(cfg.compile.components)}; caches in {os.environ.get('TORCHINDUCTOR_CACHE_DIR', '?')}: "
            f"inductor's FX graphs {on(inductor_config.fx_graph_cache)}, AOTAutograd's "
            f"{on(aot_config.enable_autograd_cache)}; key tag {tag or 'none'}"
            + ("; step 1 verified against eager (compile.verify_cache)" if cfg.compile.verify_cache else "")]


def _schedule(cfg) -> str:
    s, t, wsd = cfg.lr_scheduler, cfg.training.steps, decay_steps(cfg)
    if s.decay_type == "constant":
        return f"warmup {s.warmup_steps}, then constant"
    if wsd is None:
        return f"warmup {s.warmup_steps}, {s.decay_type} to {s.min_lr_ratio:g}x"
    return (f"warmup {s.warmup_steps}, stable to step {t - wsd}, {s.decay_type} decay over the last {wsd} steps "
            f"to {s.min_lr_ratio:g}x (WSD)")


def _lora_lines(cfg, whole, n: int) -> list[str]:
    """[lora]: what is trained (the adapters) and what stays frozen (everything else)."""
    if not cfg.lora.enable:
        return []
    found = adapters(whole)
    trained = sum(p.numel() for a in found.values() for p in a.parameters())
    lo = cfg.lora
    scale = f"alpha / sqrt(rank), rsLoRA: x{lora_scaling(lo.rank, lo.alpha, True):g}" if lo.use_rslora \
        else f"x{lora_scaling(lo.rank, lo.alpha):g}"
    # [] = PEFT's default for the architecture (checkpoint.peft_targets): the modules it chose, per block
    targets = ", ".join(lo.target_modules) or \
        "PEFT's default: " + ", ".join(sorted({re.sub(r"^.*\.\d+\.", "", fqn) for fqn in found}))
    return [f"lora       rank {lo.rank}, alpha {lo.alpha:g} (update {scale}), dropout {lo.dropout:g}: "
            f"{len(found)} adapters on {targets}; {trained / 1e6:.3f}M trainable params "
            f"({trained / n:.2%} of {n / 1e6:.2f}M), the rest frozen"]


def _loss_line(cfg, built, layout) -> str:
    what = ("cross-entropy summed over targets / all positions (end-of-document targets masked)"
            if cfg.data.mask_eod_loss else "cross-entropy, mean over targets")
    if cfg.training.objective == "dpo":
        t = cfg.training
        terms = t.dpo_loss_type + (f" weighted {cfg.dpo.loss_weights}" if cfg.dpo.loss_weights else "")
        ref = cfg.dpo.reference_path or "the starting weights"
        return (f"dpo ({terms}, beta {t.dpo_beta:g}): answer log-probs against those of {ref}; mean over the global "
                f"batch's pairs" + ("; vocab-sharded logits (loss parallel)" if layout.loss_parallel else ""))
    if cfg.training.objective == "grpo":
        g = cfg.grpo
        high = g.epsilon if g.epsilon_high < 0 else g.epsilon_high
        ratio = "sequence ratio" if g.importance_sampling_level == "sequence" else "ratio"
        policy = {"cispo": f"min({ratio}, {high:g}) (no gradient) x advantage x log-prob",
                  "sapo": f"soft-gated {ratio} (tau {g.sapo_temperature_pos:g} / {g.sapo_temperature_neg:g}) x advantage",
                  "vespo": "Gamma-weighted sequence ratio (no gradient) x advantage x log-prob"}.get(
            g.loss_type, f"clipped {ratio} [1 - {g.epsilon:g}, 1 + {high:g}]" + (f", capped at {g.delta:g}" if g.delta else "")
            + " x advantage")
        return (f"grpo ({g.loss_type}): {policy} (rewards - group "
                f"mean" + ("" if g.scale_rewards == "none" else f", / {g.scale_rewards} std") + ")"
                + (f" + {g.beta:g} x KL to the reference" if g.beta else "")
                + (f"; truncated importance sampling ({g.importance_sampling}, cap {g.importance_sampling_cap:g})"
                   if g.importance_sampling != "none" else "")
                + f"; {g.num_iterations} optimizer step(s) per batch of rollouts")
    if cfg.training.objective == "sft":
        d = cfg.data
        which = ("the assistant turns" if d.assistant_only_loss else "every token") + \
            (" (of the completion, in a prompt-completion record)" if d.completion_only_loss else "")
        which = "every token" if d.train_on_prompt else which
        what = (f"sft: cross-entropy over {which}"
                + ", summed / the targets of the whole global batch (every target weighs the same in every layout)")
    if cfg.training.fused_linear_cross_entropy:
        vocab = layout.args.vocab_size // layout.dims.tp
        return (f"{what}; fused with the LM head '{layout.spec.head}' (torchmeg.kernels.fused_ce): logits of at most "
                f"{chunk_rows(vocab, 1 << 62):,} tokens at a time (256 MiB fp32)"
                + (", vocab-sharded over TP" if layout.dims.tp > 1 else ""))
    return what + ("; vocab-sharded logits (loss parallel)" if layout.loss_parallel else "")


def _node_lines(dims) -> list[str]:
    """The header's line on nodes, for a job that spans more than one."""
    n_nodes, per_node, _ = runtime.nodes()
    if n_nodes == 1:
        return []
    return [f"nodes      {n_nodes} x {per_node} ranks: {dims.node_split(per_node)}"]


def start_lines(trainer, extra: tuple = ()) -> list[str]:
    """What rank 0 prints as a run starts: the header, `extra` lines after it, and where a resumed run
    resumed from (the checkpoint and its notes)."""
    lines = header_lines(trainer) + list(extra)
    if trainer.start_step:
        lines += [f"resumed   from step {trainer.start_step} ({trainer.ckpt.loaded_from})"] + trainer.ckpt.notes
    return lines
