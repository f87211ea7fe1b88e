"""python -m torchmeg.serve --config RECIPE [--section.key=value ...] [--host 127.0.0.1] [--port 8000]
       [--max-seqs 32] [--max-queue 256] [--max-model-len N] [--kv-cache-gib G] [--prefill-tokens 2048] [--dtype auto]
       [--served-model-name NAME] [--drain-timeout 60]

Serves the recipe's trained model over HTTP with OpenAI's API (/v1/completions,
/v1/chat/completions, streamed or not; /v1/models, /health, /metrics), batching concurrent
requests continuously. The weights: the newest committed checkpoint of the recipe's run
(--checkpoint.load_step=N, --checkpoint.folder=DIR as for torchmeg.generate), a torchmeg.convert
folder (--checkpoint.folder), or Hugging Face weights for `hf` models. This process runs the engine
and starts the HTTP server in a process of its own; under torchrun, tensor parallel over every
launched process (rank 0 runs the engine, the other ranks follow its steps).
Listens on 127.0.0.1 unless --host says otherwise. SIGTERM: stops accepting, finishes the requests in
flight for up to --drain-timeout seconds, then closes what is left (their blocks freed), exits 0.
Needs the serve extra: pip install -e '.[serve]'.
"""
from __future__ import annotations

import argparse
import os
import signal
import sys

import torch
import torch.distributed as dist

from torchmeg.batching.blocks import BLOCK
from torchmeg.config.errors import ConfigError
from torchmeg.config.extras import need
from torchmeg.config.schema import load_config
from torchmeg.data.chat import chat_template
from torchmeg.data.tokenizer import build_tokenizer
from torchmeg.inference.generate import inference_config
from torchmeg.inference.kv_replicas import replicate_kv_heads
from torchmeg.inference.trained import load_trained
from torchmeg.parallel.compile import setup as compile_setup
from torchmeg.runtime import guard
from torchmeg.runtime import process as runtime
from torchmeg.serving.kv_budget import agreed_budget, budget_bytes, pool_size
from torchmeg.inference.sampling_defaults import sampling_defaults
from torchmeg.batching.runner import follow, kv_bytes_per_token
from torchmeg.batching.static_decode import eligible
from torchmeg.train.validate import validate

PROG = "torchmeg.serve"


def parse(argv: list[str]):
    ap = argparse.ArgumentParser(prog=f"python -m {PROG}", description=__doc__.split("\n\n")[1],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", required=True, help="the recipe the model was trained with")
    ap.add_argument("--host", default="127.0.0.1", help="address to listen on (default: this machine only)")
    ap.add_argument("--port", type=int, default=8000)
    ap.add_argument("--max-seqs", type=int, default=32,
                    help="sequences decoded together at most (vLLM's --max-num-seqs); the KV pool holds what they fill "
                    "at --max-model-len, or less under --kv-cache-gib: they share its blocks as their tokens arrive")
    ap.add_argument("--max-queue", type=int, default=256, help="requests waiting for a slot; beyond: 429")
    ap.add_argument("--max-model-len", type=int, default=0,
                    help="prompt + completion tokens per sequence (default: the model's max_seq_len, or what "
                         "the KV pool holds when that is less)")
    ap.add_argument("--kv-cache-gib", type=float, default=0.0,
                    help="KV pool memory per rank, at most what --max-seqs sequences of --max-model-len fill (default: "
                         "90%% of the GPU memory free after the weights; 4 GiB on a CPU)")
    ap.add_argument("--prefill-tokens", type=int, default=2048,
                    help="prompt tokens prefilled per step beside the running decodes: a longer prompt is "
                         "prefilled in chunks (bounds the running sequences' inter-token gap)")
    ap.add_argument("--no-enable-prefix-caching", dest="prefix_caching", action="store_false",
                    help="compute every prompt whole (default: a prompt maps the cached KV blocks of 16 tokens that "
                    "hold its longest prefix, a running or finished sequence's, as vLLM's prefix caching)")
    ap.add_argument("--dtype", default="auto", choices=["auto", "fp32", "bf16"],
                    help="weights and KV cache: auto = bf16 on a GPU that has it, else fp32")
    ap.add_argument("--served-model-name", default="", help="the model id clients name (default: the job name)")
    ap.add_argument("--generation-config", default="auto", choices=["auto", "vllm"],
                    help="auto (vLLM's default): the model's generation_config.json sets the sampling defaults of "
                    "requests that leave them out (temperature, top_p, top_k, the chat max_tokens cap); vllm: "
                    "the API's own (temperature 1, top_p 1)")
    ap.add_argument("--static-decode", default="auto", choices=["auto", "on", "off"],
                    help="decode steps through one compiled step, replayed as a CUDA graph on a GPU, the batch padded "
                    "to vLLM's capture sizes (auto: on with CUDA; on a CPU each size compiles at first use)")
    ap.add_argument("--enforce-eager", action="store_true", help="vLLM's flag: every step eager (--static-decode off)")
    ap.add_argument("--drain-timeout", type=float, default=60.0,
                    help="SIGTERM: seconds the requests in flight may take to finish; then they are closed")
    return ap.parse_known_args(argv)


def prepare(argv: list[str], http: bool = True):
    """-> (args, cfg, layout, chat template, its error). `http` False: the engine alone, in this
    process (tools/serve_bench.py --engine), which needs none of the HTTP server's packages."""
    a, rest = parse(argv)
    cfg = load_config(a.config, rest)
    world = int(os.environ.get("WORLD_SIZE", "1"))
    a.kv_copies = replicate_kv_heads(cfg, world)
    layout = validate(inference_config(cfg, world), world, data=False)
    a.limit = limit = layout.args.max_seq_len
    for flag, v, lo in (("--max-seqs", a.max_seqs, 1), ("--max-queue", a.max_queue, 0), ("--port", a.port, 0),
                        ("--prefill-tokens", a.prefill_tokens, 1), ("--max-model-len", a.max_model_len or 2, 2),
                        ("--drain-timeout", a.drain_timeout, 0), ("--kv-cache-gib", a.kv_cache_gib, 0)):
        if v < lo:
            raise ConfigError(f"{flag} {v}: must be >= {lo}")
    if a.max_model_len > limit:
        raise ConfigError(f"--max-model-len {a.max_model_len}: beyond the model's max_seq_len {limit}; lower it")
    for module in ("fastapi", "uvicorn", "prometheus_client") if http else ():  # before any weight is read
        need(module, "serve", "python -m torchmeg.serve")
    try:
        template, template_error = chat_template(cfg), ""
    except ConfigError as e:
        template, template_error = None, str(e)
    # (the model's sampling defaults, checked before any weight is read)
    a.sampling = sampling_defaults(build_tokenizer(cfg.data.tokenizer), a.generation_config)
    return a, cfg, layout, template, template_error


def run(prepared) -> None:
    from torchmeg.batching.engine import Engine  # lazy: the engine's parts load only once the recipe is checked
    a, cfg, layout, template, template_error = prepared
    loaded = load_trained(cfg, layout, logits=True, kv_copies=a.kv_copies)
    model, device = loaded.built.model, loaded.device
    dtype = size_engine(a, model, device)
    rank, world = dist.get_rank(), dist.get_world_size()
    channel = (lambda plan: dist.broadcast_object_list([plan], src=0)) if world > 1 else None
    # (the queue is bounded by the API process, which sees every request first)
    engine = Engine(model, loaded.tokenizer, device, a.max_seqs, a.max_model_len, a.max_seqs + a.max_queue,
                    a.prefill_tokens, channel=channel, prefix_caching=a.prefix_caching, num_blocks=a.num_blocks,
                    static_decode=static_step(a, cfg, model, device))
    a.kv_bytes = engine.reserve()
    if rank != 0:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)  # rank 0 drains, then tells us to stop

        def receive():
            box = [None]
            dist.broadcast_object_list(box, src=0)
            return box[0]
        follow(engine.runner, receive)
    else:
        _serve_http(a, cfg, layout, loaded, engine, dtype)
    loaded = engine = model = None
    runtime.end()


def static_decode(a, model, device: torch.device) -> bool:
    """Whether the engine decodes through the static step (batching.static_decode): --static-decode,
    --enforce-eager, and what the model allows (`on` for a model that cannot: one line, the fix)."""
    if a.enforce_eager or a.static_decode == "off":
        return False
    why = eligible(model)
    if a.static_decode == "on" and why:
        raise ConfigError(f"--static-decode on: not for this model ({why}); leave it at auto")
    return not why and (a.static_decode == "on" or device.type == "cuda")


def static_step(a, cfg, model, device: torch.device) -> bool:
    """static_decode's answer; when yes, the compiled step's kernels are kept in this ISA's own inductor
    cache (parallel.compile.setup, as training's and generate's compiles are): a cache written by a
    native run and read by a run with ATen at AVX2 stopped the step at an index past the pool."""
    static = static_decode(a, model, device)
    if static:
        compile_setup(cfg.compile.cache_dir)
    return static


def size_engine(a, model, device: torch.device) -> torch.dtype:
    """The weights' dtype (--dtype), the sequences' length (--max-model-len, or what the pool holds)
    and the KV pool's blocks (--kv-cache-gib, at most what --max-seqs sequences fill) as the server sets
    them, into `a.max_model_len`, `a.num_blocks` and `a.len_note`; also tools/serve_bench.py --engine's,
    so the bench measures the engine the server runs. -> the dtype."""
    dtype = _dtype(a.dtype, device)
    if dtype != torch.float32:
        model.to(dtype)
    budget, source = budget_bytes(a.kv_cache_gib, device)
    if dist.is_initialized() and dist.get_world_size() > 1:
        budget, source = agreed_budget(budget, source, device)
    a.max_model_len, a.num_blocks, a.len_note = pool_size(a.max_seqs, a.max_model_len, a.limit,
                                                          kv_bytes_per_token(model, device), budget, source)
    return dtype


def _serve_http(a, cfg, layout, loaded, engine, dtype) -> None:
    """The HTTP server in a process of its own (serving.frontend), this one runs the engine
    (serving.relay)."""
    from torchmeg.serving.frontend import FrontendSpec  # lazy: the serve extra
    from torchmeg.serving.relay import serve
    defaults, note = a.sampling
    kv = f" (KV heads x{a.kv_copies})" if a.kv_copies > 1 else ""
    header = (f"{PROG}: {cfg.model.name}/{cfg.model.flavor} from {loaded.source} | {layout.dims.describe()}{kv} | "
              f"{str(dtype).replace('torch.', '')} | up to {a.max_seqs} sequences of {a.max_model_len} tokens "
              f"(KV pool {max(a.num_blocks - 1, 0)} blocks of {BLOCK}, {a.kv_bytes / 2 ** 30:.2f} GiB"
              f"{' per rank' if dist.get_world_size() > 1 else ''}"
              f"{'; ' + a.len_note if a.len_note else ''}) | {decode_words(engine)} | http://{a.host}:{a.port}/v1" + (f"\n{PROG}: {note}" if note else ""))
    serve(engine, FrontendSpec(loaded.tokenizer, cfg, a.served_model_name or cfg.job.name, a.max_model_len,
                               a.max_seqs, a.max_queue, a.host, a.port, a.drain_timeout, header, defaults))


def decode_words(engine) -> str:
    """How the engine decodes, as the header says it."""
    static = engine.runner.static
    if static is None:
        return "eager decode"
    return f"static decode ({'CUDA graphs, ' if static.graphs else 'compiled, '}sizes {','.join(map(str, static.sizes))})"


def _dtype(name: str, device: torch.device) -> torch.dtype:
    if name == "bf16":
        return torch.bfloat16
    if name == "auto" and device.type == "cuda" and torch.cuda.is_bf16_supported():
        return torch.bfloat16
    return torch.float32


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    return guard.cli_main(PROG, lambda: prepare(argv), run)
