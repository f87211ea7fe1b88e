"""`validate(cfg, world_size)`: every check that can run before a process group exists, each in
the module that owns it, and the Layout they imply (torchmeg.config.layout), derived here once.

Order: the recipe alone (config), the model (registry, args; the cross-section rules each owner
states: pipeline split, context-parallel attention, HF weights), the degrees against the world
and the model (parallel.*), the batch, then what must exist on disk (data, checkpoint folder) and
on the machine (features). The first failure raises ConfigError with one line.
"""
from __future__ import annotations

import dataclasses

import os

import torch

from torchmeg.config.schema import Config
from torchmeg.config.checks import check_recipe
from torchmeg.data.sources import check_data_config
from torchmeg.data.tokenizer import build_tokenizer
from torchmeg.config.errors import ConfigError
from torchmeg.config.extras import need
from torchmeg.checkpoint.folder import MARKER, committed_steps
from torchmeg.config.support import check_supported
from torchmeg.checkpoint.folder import check_folder
from torchmeg.checkpoint.hf_files import check_initial_load
from torchmeg.config.layout import Layout, StagePlan
from torchmeg.models.args import check_model_args, model_args
from torchmeg.models.attention import check_document_masking
from torchmeg.models.spec import get_spec
from torchmeg.parallel import context, expert, pipeline
from torchmeg.parallel.dims import ParallelDims
from torchmeg.parallel.mxfp8 import MX_RECIPES, torch_has_mx_training
from torchmeg.runtime.torch_versions import check_torch_version
from torchmeg.train.dpo import LOSS_TYPES, loss_terms
from torchmeg.train.rewards import load_reward_funcs


def validate(cfg: Config, world_size: int | None = None, data: bool = True) -> Layout:
    """Check everything that can be checked before a process group exists -> the run's Layout.

    world_size defaults to $WORLD_SIZE (set by torchrun) or 1. data=False (the planner) checks
    the model, layout and batch only: no tokenizer file, data set or checkpoint folder is needed
    (the vocabulary then comes from the flavor or model.vocab_size).
    """
    if world_size is None:
        world_size = int(os.environ.get("WORLD_SIZE", "1"))
    check_recipe(cfg)
    if cfg.fault_tolerance.enable and data:  # (the planner plans one group: no torchft needed)
        need("torchft", "ft", "fault_tolerance.enable")
    if cfg.training.objective == "grpo":
        # The rollout engine decodes one token per row: the sequence is not sharded over TP, and its
        # sampling reads whole logits (a TP run gathers them).
        cfg.parallelism.sequence_parallel = cfg.parallelism.loss_parallel = False
        cfg.training.loss_spike_factor = 0.0  # a policy loss hovers around 0: no scale to spike against
    spec = get_spec(cfg.model.name)
    vocab = _tokenizer_vocab(cfg, data)
    args = model_args(cfg, vocab)
    if vocab is None and args.vocab_size < 1:
        raise ConfigError(f"model.vocab_size = {args.vocab_size}: the vocabulary comes from data.tokenizer = "
                          f"{cfg.data.tokenizer!r}, which is not here; set model.vocab_size to plan without it")
    p = cfg.parallelism
    pipeline.check_splittable(spec.name, spec.pipeline, p.pipeline_parallel_degree)
    context.check_model_has_attention(spec.name, spec.context_parallel, p.context_parallel_degree)
    check_document_masking(cfg, spec.context_parallel)
    check_initial_load(cfg, spec.hf_native)
    check_model_args(cfg, spec, args, vocab)

    dims = ParallelDims.from_config(cfg, world_size)
    if dims.tp > 1 and p.sequence_parallel and getattr(args, "n_experts", 0) and not spec.hf_native:
        dims = dataclasses.replace(dims, experts_over_tp=True)
    if dims.pp > 1:
        pipeline.check(cfg, args, dims.pp)
    if dims.cp > 1:
        context.check(cfg, args, dims)
    if dims.ep > 1 or dims.experts_over_tp:
        expert.check(cfg, args, dims)
    elif p.expert_capacity_factor:
        raise ConfigError(f"parallelism.expert_capacity_factor = {p.expert_capacity_factor}: applies to expert "
                          f"parallel dispatch only; set expert_parallel_degree > 1 or leave it at 0")
    dims.check_tp(args, cfg)
    _check_dpo(cfg, dims)
    layout = _layout(cfg, world_size, dims, spec, args)
    _check_grpo(cfg, layout, data)
    _check_mxfp8(cfg, layout)
    if data:  # (a plan is of the program a cluster's torch runs: planning on any torch in the range)
        check_torch_version(cfg, args, dims)
        check_data_config(cfg)
        if cfg.checkpoint.enable:
            check_folder(cfg)
        _check_initial_path(cfg)
        check_supported(cfg, dims)
    return layout


def _check_dpo(cfg, dims) -> None:
    """The loss types and weights; what training.objective = "dpo" does not take (yet), each refused naming the key."""
    if cfg.training.objective != "dpo":
        return
    kinds = [kind for kind, _ in loss_terms(cfg)]  # (refuses a weight count that does not match)
    for kind in kinds:
        if kind not in LOSS_TYPES:
            raise ConfigError(f"training.dpo_loss_type = {cfg.training.dpo_loss_type!r}: unknown type {kind!r}; "
                              f"allowed: {', '.join(LOSS_TYPES)} (several joined by ',')")
    if "exo_pair" in kinds and cfg.dpo.label_smoothing == 0:
        raise ConfigError("dpo.label_smoothing = 0 with training.dpo_loss_type exo_pair: its loss needs a share of "
                          "flipped preferences in (0, 0.5), e.g. 1e-3")
    if cfg.dpo.label_smoothing >= 0.5:
        raise ConfigError(f"dpo.label_smoothing = {cfg.dpo.label_smoothing}: must be below 0.5")
    _check_checkpoint_path(cfg.dpo.reference_path, "dpo.reference_path")
    for key, value, bad in (("parallelism.pipeline_parallel_degree", dims.pp, dims.pp > 1),
                            ("parallelism.context_parallel_degree", dims.cp, dims.cp > 1),
                            ("training.fused_linear_cross_entropy", True, cfg.training.fused_linear_cross_entropy),
                            ("data.document_masking", True, cfg.data.document_masking)):
        if bad:
            raise ConfigError(f"{key} = {value} with training.objective = \"dpo\": not supported (a pair's rows are "
                              f"whole sequences scored by their summed log-probs); use TP, FSDP/HSDP/DDP or EP")


def _check_grpo(cfg, layout: Layout, data: bool) -> None:
    """What training.objective = "grpo" needs and does not take (yet), each refused naming the key."""
    if cfg.training.objective != "grpo":
        return
    g, dims = cfg.grpo, layout.dims
    for key, value, bad in (("parallelism.pipeline_parallel_degree", dims.pp, dims.pp > 1),
                            ("parallelism.context_parallel_degree", dims.cp, dims.cp > 1),
                            ("parallelism.expert_parallel_degree", dims.ep, dims.ep > 1),
                            ("training.fused_linear_cross_entropy", True, cfg.training.fused_linear_cross_entropy),
                            ("data.document_masking", True, cfg.data.document_masking),
                            ("compile.enable", True, cfg.compile.enable),
                            ("float8.enable", True, cfg.float8.enable),
                            ("validation.enable", True, cfg.validation.enable)):
        if bad:
            raise ConfigError(f"{key} = {value} with training.objective = \"grpo\": not supported (the rollout engine "
                              f"runs the training model one token per row; the rewards are the run's measure); use "
                              f"FSDP/HSDP/DDP and TP, LoRA, recompute")
    if layout.global_batch % g.num_generations:
        raise ConfigError(f"training.global_batch_size = {layout.global_batch}: counts completions, a whole number of "
                          f"groups of grpo.num_generations = {g.num_generations}")
    if not (g.epsilon_high == -1.0 or g.epsilon_high >= 0):
        raise ConfigError(f"grpo.epsilon_high = {g.epsilon_high}: >= 0, or -1 for grpo.epsilon")
    if g.loss_type == "vespo" and g.importance_sampling.startswith("sequence"):
        raise ConfigError(f"grpo.importance_sampling = {g.importance_sampling!r} with grpo.loss_type = \"vespo\": "
                          f"vespo folds a token ratio into its weights (as TRL); use token_truncate or token_mask")
    for key in ("sapo_temperature_pos", "sapo_temperature_neg"):
        if getattr(g, key) <= 0:
            raise ConfigError(f"grpo.{key} = {getattr(g, key)}: must be > 0 (the gate divides by it)")
    if cfg.checkpoint.enable and cfg.checkpoint.interval % g.num_iterations:
        raise ConfigError(f"checkpoint.interval = {cfg.checkpoint.interval}: a multiple of grpo.num_iterations = "
                          f"{g.num_iterations}, so a resume starts a fresh batch of rollouts")
    if data:
        load_reward_funcs(list(g.reward_funcs), list(g.reward_weights))


def _check_mxfp8(cfg, layout: Layout) -> None:
    """MXFP8 casts each weight gradient's operands in blocks of 32 tokens: a microbatch's tokens per rank
    must fill whole blocks."""
    if not (cfg.float8.enable and cfg.float8.recipe in MX_RECIPES):
        return
    if not torch_has_mx_training():
        raise ConfigError(f"float8.recipe = {cfg.float8.recipe!r}: torchao's MXFP8 training needs DTensor features this "
                          f"torch {torch.__version__} lacks (torch 2.13 and 2.14 have them): install torch>=2.13, or use "
                          f"float8.recipe = 'tensorwise' / 'rowwise'")
    rows = layout.local_batch * layout.accum // layout.microbatches if layout.stages else layout.local_batch
    tokens = rows * layout.rows_per_sample * layout.seq_len // layout.dims.cp
    if tokens % 32:
        raise ConfigError(f"float8.recipe = {cfg.float8.recipe!r}: a microbatch holds {tokens} tokens per rank "
                          f"(sequences x data.seq_len{' / cp' if layout.dims.cp > 1 else ''}); MXFP8 scales gradients "
                          f"in blocks of 32 tokens: make it a multiple of 32 (training.local_batch_size, data.seq_len)")


def _tokenizer_vocab(cfg: Config, data: bool) -> int | None:
    """The tokenizer's vocabulary size; None when planning (data=False) without the tokenizer file."""
    if not data and cfg.data.tokenizer != "byte" and not os.path.isfile(cfg.data.tokenizer):
        return None
    return build_tokenizer(cfg.data.tokenizer).vocab_size


def _layout(cfg: Config, world_size: int, dims: ParallelDims, spec, args) -> Layout:
    """The batch arithmetic (the one place it is written) and the pipeline split."""
    t = cfg.training
    unit = t.local_batch_size * dims.dp
    if t.global_batch_size != -1 and t.global_batch_size % unit:
        raise ConfigError(
            f"training.global_batch_size = {t.global_batch_size}: must be a multiple of local_batch_size x dp "
            f"= {t.local_batch_size} x {dims.dp} = {unit} (or -1)")
    accum = 1 if t.global_batch_size == -1 else t.global_batch_size // unit
    stages = None
    if dims.pp > 1:
        v, counts = pipeline.plan_stages(cfg, args.n_layers, dims.pp)
        stages = StagePlan(cfg.parallelism.pipeline_parallel_schedule, v, tuple(counts),
                           pipeline.microbatches(cfg, dims.pp, v, accum))
    return Layout(world_size=world_size, dims=dims, spec=spec, args=args, seq_len=cfg.data.seq_len,
                  local_batch=t.local_batch_size, accum=accum, global_batch=unit * accum,
                  loss_parallel=dims.uses_loss_parallel(cfg.parallelism), stages=stages,
                  rows_per_sample=2 if cfg.training.objective == "dpo" else 1)


def _check_initial_path(cfg) -> None:
    """checkpoint.initial_load_path names a committed step folder or a checkpoint folder holding one."""
    where, c = cfg.checkpoint.initial_load_path, cfg.checkpoint
    if not where:
        return
    if not c.enable:
        raise ConfigError(f"checkpoint.initial_load_path = {where!r}: needs checkpoint.enable = true (the run's own "
                          f"checkpoints resume it; the initial weights are read only when there are none)")
    if c.initial_load_hf:
        raise ConfigError("checkpoint.initial_load_path and checkpoint.initial_load_hf: give one starting point")
    _check_checkpoint_path(where, "checkpoint.initial_load_path")


def _check_checkpoint_path(where: str, key: str) -> None:
    """`key` names a committed step folder or a checkpoint folder holding one ('' = none)."""
    if where and not (os.path.isfile(os.path.join(where, MARKER)) or (os.path.isdir(where) and committed_steps(where))):
        raise ConfigError(f"{key} = {where!r}: no committed checkpoint there (a step-* folder or a checkpoint folder "
                          f"holding one); train the model it names first, or set it to \"\"")

