"""The recipe's sections as typed dataclasses: each key's type, default, allowed values or range, and
its one-line help (what `--help` prints). The keys are the public contract (RECIPES.md); loading a
recipe into them is torchmeg.config.schema's. Imports nothing of torchmeg."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Union


def _f(default, *, choices=None, lo=None, hi=None, help=""):
    meta = {"choices": choices, "lo": lo, "hi": hi, "help": help}
    if isinstance(default, list):
        return field(default_factory=lambda d=default: list(d), metadata=meta)
    return field(default=default, metadata=meta)


@dataclass
class Job:
    name: str = _f("debug_llama", help="run name; outputs go to <dump_folder>/<name>/")
    dump_folder: str = _f("./outputs")
    seed: int = _f(0, lo=0)
    cpu_keep_freed_memory: bool = _f(True, help="CPU runs: glibc keeps freed blocks up to 32 MiB for reuse instead of "
                                                "returning them to the kernel each step (fewer page faults, a few "
                                                "percent tokens/s; a little more resident memory)")


@dataclass
class Model:
    name: str = _f("llama", help="registry key")
    flavor: str = _f("debug")
    blocks: str = _f("", help="FQN of the ModuleList/ModuleDict/Sequential of repeated blocks; '' = found")
    hf_config: str = _f("", help="model.name = 'hf': a Hugging Face config.json, or a directory holding one")
    hf_attn_implementation: str = _f("sdpa", choices=["sdpa", "eager"],
                                     help="model.name = 'hf': transformers' attention kernel (eager for models "
                                          "without SDPA support, e.g. Gemma 2's soft-capped attention)")
    # Any field of the flavor's args (dim, n_layers, ...) may be set in [model]; they land here
    # and are checked against the model's own argument dataclass.
    overrides: dict = field(default_factory=dict)


@dataclass
class Data:
    dataset: Union[str, list] = _f("python_stdlib")
    weights: list = _f([])
    tokenizer: str = _f("byte")
    seq_len: int = _f(256, lo=2)
    num_workers: int = _f(0, lo=0)
    val_fraction: float = _f(0.005, lo=0.0, hi=0.5, help="held-out share of the samples")
    cache_dir: str = _f("", help="where built-in datasets are cached; '' = $TORCHMEG_CACHE or ~/.cache/torchmeg")
    document_masking: bool = _f(False, help="attention stays within each document of a window and positions "
                                           "restart at each (Megatron's --reset-attention-mask --reset-position-ids)")
    mask_eod_loss: bool = _f(False, help="no loss on a document's first token (Megatron's --eod-mask-loss)")
    chat_template: str = _f("", help="sft/dpo: '' = the tokenizer folder's own; chatml, llama3, a folder or a .jinja")
    assistant_only_loss: bool = _f(False, help="sft: in conversations only the assistant turns are targets (TRL's "
                                               "assistant_only_loss; its default false: every token)")
    completion_only_loss: bool = _f(True, help="sft: in prompt-completion records only the completion is a target "
                                               "(TRL's completion_only_loss; its default for such records)")
    train_on_prompt: bool = _f(False, help="sft: every token is a target, whatever the two keys above say")
    long_conversations: str = _f("truncate", choices=["truncate", "drop"], help="sft: longer than seq_len: cut or left out")


@dataclass
class Training:
    objective: str = _f("pretrain", choices=["pretrain", "sft", "dpo", "grpo"],
                        help="pretrain: next-token loss over every token; sft: chat data (data.dataset = .jsonl / "
                             ".parquet conversations or python_stdlib_chat), loss on the assistant tokens only, "
                             "averaged over the whole global batch's targets; dpo: preference pairs (prompt, "
                             "chosen, rejected; or python_stdlib_pairs) against the starting weights; grpo: online RL, prompts "
                             "(prompt or messages; or python_stdlib_names) answered by the model itself, scored by "
                             "[grpo] reward_funcs")
    dpo_beta: float = _f(0.1, lo=0.0, help="dpo: the KL weight beta")
    dpo_loss_type: str = _f("sigmoid", help="dpo: TRL's loss_type: sigmoid, ipo, hinge, robust, apo_zero, apo_down, "
                                           "bco_pair, nca_pair, sppo_hard, exo_pair, sigmoid_norm, or several joined "
                                           "by ',' (summed with dpo.loss_weights), e.g. 'sigmoid,sft' (RPO)")
    steps: int = _f(200, lo=1)
    local_batch_size: int = _f(8, lo=1)
    global_batch_size: int = _f(-1, lo=-1)
    max_norm: float = _f(1.0, lo=0.0)
    mixed_precision: str = _f("fp32", choices=["fp32", "bf16"])
    tf32: bool = _f(True, help="CUDA: fp32 matmuls on TF32 tensor cores (10-bit mantissa); false: full fp32")
    device: str = _f("auto", choices=["auto", "cpu", "cuda"])
    deterministic: bool = _f(False)
    on_nonfinite: str = _f("skip", choices=["skip", "stop"])
    max_consecutive_skips: int = _f(10, lo=0, help="stop after this many non-finite steps in a row; 0 = no cap")
    loss_spike_factor: float = _f(3.0, lo=0.0, help="a loss above this x the median of the last loss_spike_window "
                                                    "steps is a spike; 0 = off")
    loss_spike_window: int = _f(100, lo=1, help="steps whose losses form the running median")
    on_loss_spike: str = _f("log", choices=["log", "skip", "stop"],
                            help="log: report it and apply the step; skip: report it, no update; stop: exit 1")
    fused_linear_cross_entropy: bool = _f(False, help="the LM head and the loss computed together over chunks of "
                                                      "tokens: the [tokens, vocab] logits never exist (torchmeg.kernels.fused_ce)")
    watchdog_factor: float = _f(10.0, lo=0.0, help="a step slower than this x the median step is a hang; 0 = off")
    watchdog_min_s: float = _f(120.0, lo=1.0, help="the watchdog never fires on a step before this many seconds")
    watchdog_startup_s: float = _f(1800.0, lo=1.0, help="limit for the first steps (compile), eval, checkpoint I/O")


@dataclass
class Optimizer:
    name: str = _f("adamw", choices=["adamw", "adam", "sgd", "muon"],
                   help="muon: Muon (torch.optim.Muon's update) for the hidden matrices, AdamW (betas, eps) for "
                        "embeddings, the head, norms, biases and LoRA adapters")
    lr: float = _f(3e-3, lo=0.0)
    weight_decay: float = _f(0.1, lo=0.0)
    weight_decay_exempt: list = _f(["norms", "biases"], help="parameters that never decay: any of embeddings, head, "
                                                             "norms, biases (norms: every 1-D weight)")
    betas: list = _f([0.9, 0.95])
    eps: float = _f(1e-8, lo=0.0)
    state_dtype: str = _f("float32", choices=["float32", "bfloat16"],
                          help="dtype of the moments (Adam) / momentum (Muon); bfloat16 halves the state, the "
                               "update is computed in float32 and the weights stay in their dtype")
    muon_lr: float = _f(0.0, lo=0.0, help="Muon's rate for the hidden matrices; 0 = optimizer.lr")
    muon_momentum: float = _f(0.95, lo=0.0, hi=0.999)
    muon_nesterov: bool = _f(True)
    muon_ns_steps: int = _f(5, lo=1, hi=99, help="Newton-Schulz iterations")
    muon_ns_dtype: str = _f("bfloat16", choices=["bfloat16", "float32"],
                            help="dtype of the Newton-Schulz iteration (torch.optim.Muon: bfloat16)")
    muon_adjust_lr: str = _f("match_rms_adamw", choices=["match_rms_adamw", "original"],
                             help="match_rms_adamw: 0.2 sqrt(max(A, B)) (Moonlight: AdamW's lr and weight decay "
                                  "carry over); original: sqrt(max(1, A / B)) (Keller Jordan's)")


@dataclass
class LRScheduler:
    warmup_steps: int = _f(20, lo=0)
    decay_type: str = _f("cosine", choices=["cosine", "linear", "sqrt", "constant"],
                         help="shape of the decay: cosine, linear, sqrt (1 - sqrt(progress)) or none")
    decay_steps: int = _f(-1, lo=-1, help="-1: decay over every step after warmup; N: warmup-stable-decay (WSD), "
                                          "the peak rate held until the last N steps, which decay")
    decay_ratio: float = _f(-1.0, lo=-1.0, hi=1.0, help="WSD with the decay as a fraction of training.steps "
                                                        "(torchtitan's key); -1 = off; set this or decay_steps")
    min_lr_ratio: float = _f(0.1, lo=0.0, hi=1.0)


@dataclass
class Parallelism:
    data_parallel_replicate_degree: int = _f(1, lo=1)
    data_parallel_shard_degree: int = _f(-1, lo=-1)
    tensor_parallel_degree: int = _f(1, lo=1)
    sequence_parallel: bool = _f(True)
    loss_parallel: bool = _f(True)
    pipeline_parallel_degree: int = _f(1, lo=1)
    pipeline_parallel_schedule: str = _f(
        "1F1B", choices=["GPipe", "1F1B", "Interleaved1F1B", "InterleavedZeroBubble", "ZBVZeroBubble", "DualPipeV"])
    pipeline_parallel_microbatches: int = _f(-1, lo=-1)
    pipeline_parallel_layers_per_stage: Union[int, list] = _f(-1)
    context_parallel_degree: int = _f(1, lo=1)
    context_parallel_mode: str = _f("allgather", choices=["allgather", "ring", "alltoall"],
                                    help="K/V exchange of context-parallel attention")
    expert_parallel_degree: int = _f(1, lo=1)
    expert_capacity_factor: float = _f(0.0, lo=0.0, help="EP: 0 = dropless (one host read per layer); > 0 = fixed "
                                       "capacity per peer, no host read, tokens beyond it dropped (ep: none dropped)")
    enable_async_tensor_parallel: bool = _f(False)
    fsdp_reshard_after_forward: bool = _f(True)
    fsdp_reshard_per_microbatch: bool = _f(False, help="under PP: FSDP gathers per microbatch (true) or per step")


@dataclass
class ActivationCheckpoint:
    mode: str = _f("none", choices=["none", "full", "selective"])
    selective_option: Union[str, int] = _f("op", help="op | op_half (every other matmul recomputed) | N")


@dataclass
class Compile:
    enable: bool = _f(False)
    components: list = _f(["model", "loss"])
    cache_dir: str = _f("", help="inductor's kernel cache; '' = TORCHINDUCTOR_CACHE_DIR or torch's default")
    verify_cache: bool = _f(False, help="run the first step once more in eager mode beside the compiled one and "
                            "stop if the loss or grad norm differ beyond compile's rounding (a compiled "
                            "program, cached or fresh, that computes something else)")


@dataclass
class Float8:
    enable: bool = _f(False)
    recipe: str = _f("tensorwise", choices=["tensorwise", "rowwise", "rowwise_with_gw_hp", "mxfp8",
                                            "mxfp8_wgrad_with_hp"],
                     help="torchao's: tensorwise / rowwise scales (float8 tensor cores: sm_89+), or mxfp8: one "
                          "e8m0 scale per 32 elements (MX tensor cores: sm_100+); elsewhere emulated")
    emulate: Union[str, bool] = _f("auto")
    enable_fsdp_float8_all_gather: bool = _f(False)
    filter_fqns: list = _f(["output", "lm_head"])
    mx_experts: bool = _f(True, help="mxfp8 recipes: the grouped MoE experts' matmuls in MXFP8 too")


@dataclass
class Checkpoint:
    enable: bool = _f(False)
    folder: str = _f("checkpoint")
    interval: int = _f(100, lo=1)
    keep_latest_k: int = _f(2, lo=0)
    async_mode: str = _f("disabled", choices=["disabled", "async"])
    load_step: int = _f(-1, lo=-1)
    export_hf: bool = _f(False)
    initial_load_hf: str = _f("", help="a Hugging Face safetensors directory to start from (model.name = 'hf'), "
                              "when there is no checkpoint to resume; each rank reads only its shard")
    initial_load_path: str = _f("", help="a fresh run (nothing in checkpoint.folder to resume) starts from the model "
                                "weights of this checkpoint (a step folder, or a checkpoint folder: its newest "
                                "committed step); step, optimizer and data start anew (fine-tuning)")
    last_save_model_only: bool = _f(False, help="the final checkpoint holds model weights only")
    export_dtype: str = _f("float32", choices=["float32", "bfloat16"], help="dtype of a model-only final save")
    on_damaged: str = _f("fallback", choices=["fallback", "stop"],
                         help="a damaged newest checkpoint: load the previous complete one, or stop")
    verify: bool = _f(True, help="record file sizes and CRC32s at commit; check them before loading")
    remap_data_position: bool = _f(False, help="allow resuming with another global batch / seq_len; "
                                   "the data position then follows the tokens consumed")


@dataclass
class Validation:
    enable: bool = _f(False)
    freq: int = _f(100, lo=1)
    steps: int = _f(10, lo=1)


@dataclass
class Metrics:
    log_freq: int = _f(10, lo=1)
    enable_tensorboard: bool = _f(True)
    jsonl: bool = _f(True)


@dataclass
class Profiling:
    enable: bool = _f(False)
    profile_freq: int = _f(100, lo=1)
    active_steps: int = _f(2, lo=1, help="steps recorded at the end of each profile_freq window")
    memory: bool = _f(True, help="also a memory snapshot (CUDA) or memory timeline (CPU) per window")


@dataclass
class Comm:
    # As torchtitan's comm.*_timeout_seconds: a long limit while ranks may legitimately wait on each
    # other for minutes (start-up, compilation of the first steps, evaluation, checkpoint I/O), a
    # shorter one between steady training steps. Each stays above the watchdog's limit for the same
    # phase, so a hang is reported by the watchdog (phase, stacks) before a collective times out.
    init_timeout_seconds: float = _f(2400.0, lo=1.0, help="collective timeout at start-up, in the first training "
                                                          "steps, evaluation and checkpoint I/O; must exceed "
                                                          "training.watchdog_startup_s")
    train_timeout_seconds: float = _f(600.0, lo=1.0, help="collective timeout in steady training steps (raised to "
                                                          "1.25 x the watchdog's step limit when that is longer); "
                                                          "must exceed training.watchdog_min_s")


@dataclass
class Plan:
    world_size: int = _f(0, lo=0, help="the world this recipe is meant for (python -m torchmeg.plan); 0 = from the "
                                        "degrees, which then must not use data_parallel_shard_degree = -1")
    gpu: str = _f("h100", choices=["h100", "h100-500w", "h200", "b200", "a100", "cpu"],
                  help="the device python -m torchmeg.plan predicts for; cpu: this machine, as calibrated")
    calibration: str = _f("", help="a calibration file (python -m torchmeg.plan --calibrate): the predicted step from "
                                   "what that device measured, op by op; '' = the GPU's data-sheet efficiencies "
                                   "(cpu: the default calibration of this machine)")
    trace_layers: str = _f("sampled", choices=["sampled", "all"],
                           help="sampled: trace the first and last layer of each pipeline stage and two of each kind "
                                "between, scaled to the whole depth (torchmeg.plan.depth); all: trace every layer")
    trace_cache: str = _f("", help="a folder where the dry run keeps each trace: a plan that traces the same program "
                                   "again (another GPU, async TP or compile on or off, a search after a plan) reads it "
                                   "instead (torchmeg.plan.trace_cache); '' = off")
    cache_bytes: int = _f(0, lo=0, help="the last-level cache one rank of the device has: a memory-bound op's inputs "
                                        "last touched more than this much traffic ago are priced at DRAM's rate "
                                        "(torchmeg.plan.reuse); 0 = the calibration's (none: every op warm)")


@dataclass
class Dpo:
    reference_path: str = _f("", help="dpo: the reference model's checkpoint (a step folder, or a checkpoint folder: its "
                                      "newest); '' = the weights the run starts from")
    loss_weights: list = _f([], help="dpo: a weight per training.dpo_loss_type term (TRL's loss_weights); [] = all 1")
    label_smoothing: float = _f(0.0, lo=0.0, hi=0.5, help="dpo: the share of flipped preferences assumed (robust, "
                                                          "exo_pair: TRL's label_smoothing)")


@dataclass
class Grpo:
    num_generations: int = _f(8, lo=2, help="completions per prompt (the group); training.global_batch_size counts "
                                            "completions, a multiple of it")
    max_prompt_length: int = _f(256, lo=1, help="a longer prompt is refused, naming its record")
    max_completion_length: int = _f(512, lo=1, help="tokens generated at most per completion (TRL's default)")
    temperature: float = _f(1.0, lo=0.0, help="sampling temperature of the rollouts (and of the log-probs trained)")
    top_p: float = _f(1.0, lo=0.0, hi=1.0, help="nucleus sampling of the rollouts; 1 = off")
    top_k: int = _f(0, lo=0, help="top-k sampling of the rollouts; 0 = off")
    reward_funcs: list = _f([], help="'module:function' each, called as TRL calls them: f(prompts=, completions=, "
                                     "completion_ids=, <other columns>=, **kw) -> a float (or None) per completion")
    reward_weights: list = _f([], help="a weight per reward function; [] = all 1")
    scale_rewards: str = _f("group", choices=["group", "batch", "none"],
                            help="advantages divided by the group's reward std, the batch's, or not at all (Dr. GRPO)")
    loss_type: str = _f("dapo", choices=["grpo", "dr_grpo", "dapo", "bnpo", "cispo", "sapo", "luspo", "vespo"],
                        help="TRL's: grpo per sequence; dr_grpo by rows x max_completion_length; dapo by the global "
                             "batch's completion tokens (TRL's default); bnpo by each microbatch's; cispo, sapo, "
                             "luspo, vespo as TRL 1.16 (docs/grpo.md)")
    importance_sampling_level: str = _f("token", choices=["token", "sequence"],
                                        help="the policy ratio per token, or per completion (GSPO: its mean log-ratio)")
    delta: float = _f(0.0, lo=0.0, help="two-sided clipping: the ratio capped at delta (INTELLECT-2; > 1 + "
                                        "epsilon_high); 0 = off (TRL's None)")
    sapo_temperature_pos: float = _f(1.0, lo=0.0, help="sapo: the gate's temperature for positive advantages")
    sapo_temperature_neg: float = _f(1.05, lo=0.0, help="sapo: the gate's temperature for the others")
    vespo_k_pos: float = _f(2.0, help="vespo: k for non-negative advantages")
    vespo_lambda_pos: float = _f(3.0, help="vespo: lambda for non-negative advantages")
    vespo_k_neg: float = _f(3.0, help="vespo: k for negative advantages")
    vespo_lambda_neg: float = _f(2.0, help="vespo: lambda for negative advantages")
    beta: float = _f(0.0, lo=0.0, help="KL weight to the reference (the starting weights); 0 = no reference kept")
    use_bias_correction_kl: bool = _f(True, help="the KL term times the importance ratio (TRL's default: the unbiased "
                                                 "reverse-KL gradient of DeepSeek-V3.2); false = TRL before 1.x")
    epsilon: float = _f(0.2, lo=0.0, help="clip range below 1 of the ratio")
    epsilon_high: float = _f(-1.0, help="clip range above 1 (DAPO: 0.28); -1 = epsilon")
    num_iterations: int = _f(1, lo=1, help="optimizer steps per batch of rollouts (PPO epochs, TRL's mu)")
    mask_truncated_completions: bool = _f(False, help="completions cut at max_completion_length get no loss (DAPO)")
    importance_sampling: str = _f("none", choices=["none", "token_truncate", "token_mask", "sequence_truncate",
                                                   "sequence_mask"],
                                  help="truncated importance sampling: the engine's vs the trainer's log-probs")
    importance_sampling_cap: float = _f(3.0, lo=1.0, help="the ratio's upper bound (truncated, or masked beyond)")
    log_completions: bool = _f(False, help="rank 0 writes every rollout (prompt, completion, rewards) to "
                                           "<run>/completions.jsonl")


@dataclass
class Lora:
    enable: bool = _f(False, help="LoRA: the model frozen, low-rank adapters beside the target Linears trained")
    rank: int = _f(8, lo=1, help="r: the adapters' inner dimension (PEFT's r; its default)")
    alpha: float = _f(8.0, lo=0.0, help="the update is scaled by alpha / rank (PEFT's lora_alpha; its default)")
    dropout: float = _f(0.0, lo=0.0, hi=0.99, help="dropout on the adapters' input (PEFT's lora_dropout)")
    use_rslora: bool = _f(False, help="rsLoRA (PEFT's use_rslora): the update scaled by alpha / sqrt(rank)")
    init_lora_weights: Union[bool, str] = _f(True, choices=[True, "gaussian"],
                                             help="PEFT's init_lora_weights: true (its default: A kaiming-uniform "
                                                  "as nn.Linear's) or 'gaussian' (A ~ N(0, 1/rank)); B = 0")
    target_modules: list = _f([], help="[] (PEFT's default, its target_modules=None): the architecture's own "
                                       "(q_proj and v_proj on Llama and Qwen3, c_attn on GPT-2; none for gpt-oss, "
                                       "DeepSeek-V3 or Qwen3-MoE: name them); module patterns ('*' one name: "
                                       "'layers.*.attention.wq'); or 'all-linear': every Linear in the blocks but "
                                       "MoE routers")
    merge_on_export: bool = _f(False, help="checkpoint.export_hf writes the merged weights instead of base + adapter")



@dataclass
class FaultTolerance:
    # torchtitan's [fault_tolerance] keys (torchft): replica groups, each a torchrun job of its own, data
    # parallel across them through torchft's managed process group; python -m torchmeg.replicas starts the
    # lighthouse and the groups (docs/fault-tolerance.md).
    enable: bool = _f(False, help="train as one replica group of several (torchft; pip install 'torchmeg[ft]')")
    replica_id: int = _f(0, lo=0, help="this group's number, 0 .. group_size - 1 (its outputs go to "
                                       "<dump_folder>/<name>/replica_<id>/)")
    group_size: int = _f(1, lo=1, help="how many replica groups the job has (the launcher's --groups)")
    min_replica_size: int = _f(1, lo=1, help="a step commits only with at least this many groups taking part")
    process_group: str = _f("gloo", choices=["gloo", "nccl"], help="the cross-group process group's backend "
                                                                   "(nccl: CUDA only)")
    process_group_timeout_ms: int = _f(10000, lo=100, help="a cross-group collective or heal transfer that takes "
                                                           "longer fails, and the step is discarded; must stay "
                                                           "under training.watchdog_min_s")
    quorum_timeout_s: float = _f(120.0, lo=1.0, help="how long a step waits for the lighthouse's quorum (a group "
                                                      "restarting, stragglers) before the run fails")
    lighthouse: str = _f("", help="the lighthouse's address (http://host:port); '' = $TORCHFT_LIGHTHOUSE")
    semi_sync_method: str = _f("none", choices=["none", "local_sgd", "diloco"],
                               help="none: every step all-reduces gradients across groups; diloco: each group "
                                    "trains sync_steps inner steps alone, then an outer SGD steps the global weights "
                                    "with the groups' mean pseudo-gradient; local_sgd: the groups' weights averaged "
                                    "every sync_steps (torchmeg/train/semi_sync.py)")
    sync_steps: int = _f(1, lo=1, help="semi-synchronous methods: inner steps between syncs (a round); the quorum is "
                                       "taken, and a late group healed, at each round's start")
    outer_lr: float = _f(0.7, lo=0.0, help="diloco: the outer SGD's learning rate (DiLoCo's 0.7)")
    outer_momentum: float = _f(0.9, lo=0.0, hi=0.999, help="diloco: the outer SGD's Nesterov momentum (DiLoCo's 0.9; "
                                                           "0 = plain SGD)")
    log_weights_hash: bool = _f(False, help="each logged step carries weights_hash, a digest of the weights after "
                                            "the update: equal in every group while they agree (hashes every "
                                            "parameter byte: for checks, not for big runs)")
