"""Plain single-device models (llama, gpt2, moe, deepseek_v3, gpt_oss; any transformers causal LM as `hf`) and the registry
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

from torchmeg import _facade

# Each public name and the module it lives in, imported on first use (PEP 562; see torchmeg._facade).
_PUBLIC = {**dict.fromkeys(('ModelSpec', 'REGISTRY', 'register', 'get_spec', 'pad_vocab', 'spec_tp_plan'), 'torchmeg.models.spec'),
           **dict.fromkeys(('build_model', 'model_args', 'check_model_args'), 'torchmeg.models.args'),
           **dict.fromkeys(('init_weights', 'materialize', 'param_seed', 'canonical_fqn'), 'torchmeg.models.init'),
           **dict.fromkeys(('count_params', 'active_params', 'flops_per_token'), 'torchmeg.models.count')}
__all__ = sorted(_PUBLIC)

__getattr__ = _facade(__name__, _PUBLIC)
