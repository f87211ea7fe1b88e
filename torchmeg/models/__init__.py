"""Plain single-device models (llama, gpt2, moe; any transformers causal LM as `hf`) and the registry
that describes them to the parallel code as data.

  spec.py    ModelSpec, register(), get_spec(): name -> class, args, flavors, TP plan, pipeline split
  args.py    a recipe's [model] section -> checked args; build_model()
  init.py    initialisation from (seed, FQN), each rank filling only its own shards
  count.py   parameters and training FLOPs
  blocks.py  where a model's repeated blocks are; tying.py: tied parameters

The public names below resolve on first use (PEP 562), so importing one submodule, e.g.
`torchmeg.models.blocks` from the parallel code, never loads the registry and its families.
"""
from __future__ import annotations


def __getattr__(name: str):
    # Each import below is lazy by design (see the docstring).
    if name in ("ModelSpec", "REGISTRY", "register", "get_spec", "pad_vocab", "spec_tp_plan"):
        from torchmeg.models import spec
        return getattr(spec, name)
    if name in ("build_model", "model_args", "check_model_args"):
        from torchmeg.models import args
        return getattr(args, name)
    if name in ("init_weights", "materialize", "param_seed", "canonical_fqn"):
        from torchmeg.models import init
        return getattr(init, name)
    if name in ("count_params", "active_params", "flops_per_token"):
        from torchmeg.models import count
        return getattr(count, name)
    raise AttributeError(f"module 'torchmeg.models' has no attribute {name!r}")
