"""What one training step costs a rank, op by op, measured by running it (on real or fake tensors).

StepCost is torch's CommDebugMode (its tables of collective ops) plus, for every other op, the FLOPs
(torch.utils.flop_counter's formulas) and the bytes it reads and writes. Like CommDebugMode it
lets DTensor desugar first (returning NotImplemented for DTensor-level ops), so what it sees are
the *local* ops a rank really runs and the collectives DTensor issues: per-rank numbers, where
FlopCounterMode alone would count a TP matmul's global FLOPs. Each collective is attributed to the
mesh dimension whose process group carried it.
"""
from __future__ import annotations

import contextlib
from collections import defaultdict

import torch
import torch.distributed as dist
from torch._guards import active_fake_mode
from torch._subclasses.fake_tensor import FakeTensor
from torch.distributed.pipelining import schedules
from torch.distributed.tensor.debug import CommDebugMode
from torch.distributed.tensor.debug._comm_mode import NATIVE_TO_PY_MAPPING, c10d_collective_ops
from torch.utils._python_dispatch import TorchDispatchMode, is_traceable_wrapper_subclass_type
from torch.utils.flop_counter import flop_registry

from torchmeg.plan.memory import tensors as _tensors
from torchmeg.plan.op_kinds import ALIASES, FORMULAS, SHAPED, argument, mnk, moves_data
from torchmeg.plan.op_fusion import Traffic, fused_bytes, storage_key, traffic
from torchmeg.plan.reuse import cold_bytes

_DEVICE = torch.ops.prim.device.default
_ACCUMULATE_GRAD = torch._C._functions.AccumulateGrad


def device_of(func, types, args):
    """A tensor's device, asked by the autograd engine and by ops of a fake tensor (`prim.device`: more
    than half of all dispatches of a fake training step; 34,430 of 61,273 in a gpt-oss trace). It moves
    no data and allocates nothing, so no mode below (the memory tracker, whose peak is already current)
    has anything to count: a fake tensor is asked directly, through FakeTensor's own handler (where the
    query ends when it passes every mode), without passing through them; any other goes on down the stack."""
    if len(args) == 1 and isinstance(args[0], FakeTensor):
        return FakeTensor.__torch_dispatch__(func, types, args, {})
    return func(*args)


# Bytes each rank sends per byte of the collective's buffer, ring algorithms over n ranks
# (NCCL's "bus bandwidth" factors; Thakur et al. 2005).
_WIRE = {"all_gather": lambda n: (n - 1) / n, "reduce_scatter": lambda n: (n - 1) / n,
         "all_reduce": lambda n: 2 * (n - 1) / n, "all_to_all": lambda n: (n - 1) / n,
         "broadcast": lambda n: 1.0, "send": lambda n: 1.0, "recv": lambda n: 0.0}


def collective_kind(op_name: str) -> str:
    n = op_name.lower()
    for kind in ("reduce_scatter", "all_to_all", "alltoall", "broadcast", "send", "recv"):
        if kind in n:
            return "all_to_all" if kind == "alltoall" else kind
    if "gather" in n:
        return "all_gather"
    if "reduce" in n:
        return "all_reduce"
    return n


def mesh_group_labels(*meshes) -> dict[str, str]:
    """Process-group name -> the mesh dimension it serves (flattened dims too; first name wins)."""
    labels = {}
    for m in meshes:
        for name in ("pp", "dp_replicate", "dp_shard", "cp", "tp", "dp", "dp_shard_cp", "dp_cp", "efsdp", "ep", "ep_tp"):
            try:
                sub = m[name]
            except (KeyError, RuntimeError, ValueError):
                continue
            labels.setdefault(sub.get_group().group_name, name)
    return labels


def _group_name(args) -> str | None:
    """The process group of a collective's arguments: a c10d ProcessGroup object, or for
    functional collectives the group name (their last string argument; an earlier one is the
    reduce op)."""
    names = [a for a in args if isinstance(a, str)]
    if names:
        return names[-1]
    for a in args:
        if isinstance(a, (torch.ScriptObject, dist.ProcessGroup)):
            try:
                pg = a if isinstance(a, dist.ProcessGroup) else dist.ProcessGroup.unbox(a)
                return pg.group_name
            except Exception:  # noqa: BLE001 - another kind of script object
                continue
    return None


# fusable_wire_bytes: the part of wire_bytes whose collective torch's async-TP pass could fuse with a
# matmul (StepCost._trace_origin)
_SUMMED = ("count", "bytes", "wire_bytes", "fusable_wire_bytes")


def add_comm(comm: dict, key, c: dict, times: int) -> None:
    """Add `times` x one collective entry {count, bytes, wire_bytes, ranks[, fusable_wire_bytes]} into comm[key]."""
    d = comm.setdefault(key, {"count": 0, "bytes": 0, "wire_bytes": 0.0, "fusable_wire_bytes": 0.0,
                              "ranks": c["ranks"]})
    for k in _SUMMED:
        d[k] = d.get(k, 0) + c.get(k, 0) * times


# Library kernels (never fused by the compiler) and FSDP's eager copy-in / copy-out around its
# collectives; everything else that moves data is a pointwise op or reduction Inductor can fuse.
_ATTENTION = "scaled_dot_product"
_UNFUSABLE = {"_chunk_cat", "split_with_sizes_copy", "_foreach_copy_"}


class StepCost(CommDebugMode):
    """ops: one (flops, bytes, dtype, kind, fused bytes, cold bytes) per data-moving op: `dtype` the first input's
    for ops with FLOPs, the op's name for the others (aten's: "silu_backward"); `kind` one of matmul,
    matmul/G (a grouped matmul of G groups: MoE's experts), attention, attention_causal (each + "_backward"
    for the gradient's kernel), memory, subclass (a tensor subclass's op: no work, its host cost only);
    a plain matmul's kind carries its shape, "matmul@MxNxK";
    `fused bytes` what the op moves once torch.compile fuses it with its neighbours (torchmeg.plan.op_fusion);
    `cold bytes` what a memory-bound op reads from beyond the cache (torchmeg.plan.reuse; 0 without a cache size)."""

    def __init__(self, group_labels: dict[str, str] | None = None, memory=None):
        super().__init__()
        self.labels = group_labels or {}
        self.memory = memory  # the memory tracker (memory.step_memory) just below this mode, if any
        self.ops = []
        self.op_names = []
        # per op: whether it adds a microbatch's gradient into the one accumulated (autograd's
        # AccumulateGrad, FSDP's accumulation in the reduce dtype: `accumulating`), which a step's
        # first microbatch does not do (repeat(..., first=True))
        self.op_accumulates = []
        self.accumulating = False
        self._traffic: list[Traffic] = []
        self._eager = False        # inside a region the compiler does not see (the optimizer's update)
        self._boundary = False     # a collective ran since the last op: fusion cannot cross it
        self.collectives = defaultdict(lambda: {"count": 0, "bytes": 0, "wire_bytes": 0.0, "fusable_wire_bytes": 0.0,
                                                "ranks": 1})
        # storage -> where its bytes came from: "mm" (a matmul's output) or an all-gather's entry
        # [key, wire bytes, fused yet]; what _trace_origin follows
        self._origin: dict = {}

    def __enter__(self):
        # CommDebugMode's per-module tracker is left out: its hooks fail on a module run from
        # inside a pipeline schedule (IndexError in _fw_set_module_hook, torch 2.13); collectives
        # are counted per step and per mesh dim here, not per module.
        self.comm_counts.clear()
        self._fake_on_entry = active_fake_mode()
        # Point-to-point traffic (the context-parallel ring, pipeline stages) goes through
        # dist.batch_isend_irecv and pipelining's _batch_p2p: ProcessGroup calls that no dispatch
        # mode sees, so it is counted there.
        self._saved_p2p = (dist.batch_isend_irecv, schedules._batch_p2p)
        dist.batch_isend_irecv = lambda ops: self._count_p2p(ops, self._saved_p2p[0])
        schedules._batch_p2p = lambda ops, desc=None: self._count_p2p(ops, self._saved_p2p[1], desc)
        TorchDispatchMode.__enter__(self)
        return self

    def __exit__(self, *args):
        dist.batch_isend_irecv, schedules._batch_p2p = self._saved_p2p
        TorchDispatchMode.__exit__(self, *args)
        done = len(self.ops) - len(self._traffic)
        fused = fused_bytes(self._traffic)
        self.ops[done:] = [(*op[:4], fb, *op[5:]) for op, fb in zip(self.ops[done:], fused)]
        self._traffic = []

    @contextlib.contextmanager
    def eager(self):
        """Ops run here stay unfused under torch.compile (the trainer compiles model and loss only)."""
        before, self._eager = self._eager, True
        try:
            yield
        finally:
            self._eager = before

    def _count_p2p(self, p2p_ops, original, *rest):
        if getattr(self, "_in_p2p", False):  # _batch_p2p passing a mixed batch on: counted once
            return original(p2p_ops, *rest)
        for op in p2p_ops:
            group = op.group if op.group is not None else dist.group.WORLD
            label = self.labels.get(group.group_name, group.group_name)
            kind = "send" if op.op in (dist.isend, dist.send) else "recv"
            nbytes = op.tensor.numel() * op.tensor.element_size()
            c = self.collectives[(label, kind)]
            c["count"] += 1
            c["bytes"] += nbytes
            c["wire_bytes"] += nbytes if kind == "send" else 0.0
            c["ranks"] = 2
        self._in_p2p = True
        try:
            return original(p2p_ops, *rest)
        finally:
            self._in_p2p = False

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is _DEVICE:  # (a device query: half of a fake step's dispatches; see device_of)
            return device_of(func, types, args)
        # As CommDebugMode: a DTensor op returns NotImplemented, so DTensor runs it as local ops
        # and collectives, which come back through here; those are what a rank really runs.
        # (and so do other wrapper subclasses: torchao's float8 tensors run their _scaled_mm here)
        if any(is_traceable_wrapper_subclass_type(t) for t in types):
            if not isinstance(func, torch._ops.HigherOrderOperator) and active_fake_mode() is self._fake_on_entry:
                self._subclass_op(func)
            return NotImplemented
        kwargs = kwargs or {}
        # (an op the memory tracker below would count nothing of runs past it: memory.step_memory's past)
        passed = self.memory.past(func, args, kwargs) if self.memory is not None else None
        out = passed[0] if passed is not None else func(*args, **kwargs)
        if isinstance(func, torch._ops.HigherOrderOperator) or active_fake_mode() is not self._fake_on_entry:
            return out  # (DTensor's sharding propagation runs ops under a fake mode of its own)
        packet = func._overloadpacket
        if packet in self.comm_registry or packet in c10d_collective_ops:
            self.comm_counts[NATIVE_TO_PY_MAPPING.get(packet, packet)] += 1
            self._collective(func, args, out)
        else:
            self._trace_origin(packet.__name__, args, out)
            if moves_data(func, out):
                self._compute(func, args, kwargs, out)
        return out

    def _trace_origin(self, name: str, args, out) -> None:
        """Follow bytes from matmuls and all-gathers to the collectives and matmuls that take them, as
        torch's async-TP pass matches its patterns (torch/_inductor/fx_passes/micro_pipeline_tp.py):
        an all-gather is fused when its result (through reshapes, and the split + cat that reassemble a
        gather along a later dim) is a matmul's left operand; a reduce-scatter when its input is one
        matmul's output (through the same). Views share their base's storage, so only ops that copy
        carry an origin on; any other op's output starts clean."""
        first = next(_tensors(list(args)), None)
        if name in _MATMULS and first is not None:
            origin = self._origin.get(storage_key(first))
            if isinstance(origin, list) and not origin[2]:  # an all-gather's result, this matmul's lhs
                origin[2] = True
                self.collectives[origin[0]]["fusable_wire_bytes"] += origin[1]
        inherit = self._origin.get(storage_key(first)) if name in _CARRY and first is not None else None
        keep = {storage_key(t) for t in _tensors(list(args))}
        for t in _tensors(out):
            key = storage_key(t)
            if name in _MATMULS:
                self._origin[key] = "mm"
            elif inherit is not None:
                self._origin[key] = inherit
            elif key not in keep:
                self._origin.pop(key, None)

    def _collective(self, func, args, out) -> None:
        name = _group_name(args)
        label = self.labels.get(name, name or "?")
        size = dist.distributed_c10d._resolve_process_group(name).size() if name else 1
        kind = collective_kind(func._overloadpacket.__name__)
        if kind == "all_to_all":
            # what this rank sends (functional: input first; c10d: output first): what it receives
            # follows the routing, the sends sum to the same over the ranks
            sent = args[0] if func.namespace == "_c10d_functional" else args[1]
            buf = sent.numel() * sent.element_size()
        else:
            buf = max((t.numel() * t.element_size() for t in _tensors([args, out])), default=0)
        c = self.collectives[(label, kind)]
        wire = buf * _WIRE.get(kind, lambda n: 1.0)(size)
        c["count"] += 1
        c["bytes"] += buf
        c["wire_bytes"] += wire
        c["ranks"] = size
        self._boundary = True
        cold_bytes(args, out, buf)  # (the clock: its bytes went by)
        first = next(_tensors(list(args)), None)
        if kind == "reduce_scatter" and first is not None and self._origin.get(storage_key(first)) == "mm":
            c["fusable_wire_bytes"] += wire
        for t in _tensors(out):
            self._origin[storage_key(t)] = [(label, kind), wire, False] if kind == "all_gather" else None

    def _compute(self, func, args, kwargs, out) -> None:
        packet = ALIASES.get(func._overloadpacket, func._overloadpacket)
        flops = 0
        formula = flop_registry.get(packet) or FORMULAS.get(packet)
        if formula is not None:
            flops = formula(*args, **kwargs, out_val=out)
        nbytes = sum(t.numel() * t.element_size() for t in _tensors([list(args), out]))
        dtype = None
        name = packet.__name__
        if flops:
            first = next(_tensors(list(args)), None)
            dtype = str(first.dtype).replace("torch.", "") if first is not None else None
        elif _ATTENTION not in name:
            dtype = name  # (a memory-bound op: its name, which a calibrated CPU prices: exp is not a copy)
        if _ATTENTION in name:
            kind = "attention_causal" if argument(func, args, kwargs, "is_causal") else "attention"
            kind += "_backward" if name.endswith("_backward") else ""
        else:
            kind = "matmul" if flops else "memory"
            if name == "_grouped_mm" and flops:  # one matmul per group: a calibrated device prices each
                offs = argument(func, args, kwargs, "offs")
                kind = f"matmul/{offs.numel() if offs is not None else args[0].shape[0]}"
            elif flops and name in SHAPED:
                kind = f"matmul@{mnk(name, args)}"  # (a calibrated device prices it by its shape)
        fusable = kind == "memory" and not self._eager and func.namespace == "aten" and name not in _UNFUSABLE
        tr = traffic(args, out, fusable, _tensors)
        tr.starts_group, self._boundary = self._boundary, False
        self._traffic.append(tr)
        cold = cold_bytes(args, out, nbytes)
        self.ops.append((flops, nbytes, dtype, kind, nbytes, cold if kind == "memory" else 0))
        self.op_names.append(str(packet))
        self.op_accumulates.append(self.accumulating or isinstance(torch._C._current_autograd_node(), _ACCUMULATE_GRAD))

    def _subclass_op(self, func) -> None:
        """A tensor subclass's op (DTensor's, torchao's float8): no kernel of its own (its local ops come
        back through here), but its host work (DTensor's sharding propagation, in Python) is a cost a
        calibrated device prices per op (torchmeg.plan.calibrated): one (0, 0, None, "subclass", 0, 0)."""
        self._traffic.append(Traffic(ghost=True))
        self.ops.append((0, 0, None, "subclass", 0, 0))
        self.op_names.append(str(func._overloadpacket))
        self.op_accumulates.append(False)

    def dtensor_op(self, func) -> None:
        """An op a real step runs on DTensors that the trace ran on their local shards (the optimizer's
        update, torchmeg.plan.local_update): its host cost, as a subclass op's."""
        self._subclass_op(func)

    def mark(self) -> tuple:
        """Where the tables stand now, for repeat()."""
        return len(self.ops), {k: dict(v) for k, v in self.collectives.items()}

    def repeat(self, start: tuple, end: tuple, times: int, first: bool = False) -> None:
        """Count what ran between two marks `times` more times (identical microbatches of a step);
        `first`: as a step's first microbatch, which has no gradient to add its own to (the ops that
        accumulate one left out; what it does instead is the caller's: extend())."""
        (i, c0), (j, c1) = start, end
        keep = [k for k in range(i, j) if not (first and self.op_accumulates[k])]
        self.ops += [self.ops[k] for k in keep] * times
        self.op_names += [self.op_names[k] for k in keep] * times
        self.op_accumulates += [self.op_accumulates[k] for k in keep] * times
        for key, c in c1.items():
            before = c0.get(key, {"count": 0, "bytes": 0, "wire_bytes": 0.0})
            add_comm(self.collectives, key, {**c, **{k: c.get(k, 0) - before.get(k, 0) for k in _SUMMED}}, times)

    def extend(self, other: "StepCost") -> None:
        """Count another StepCost's ops and collectives as this one's."""
        self.ops += other.ops
        self.op_names += other.op_names
        self.op_accumulates += other.op_accumulates
        for key, c in other.collectives.items():
            add_comm(self.collectives, key, c, 1)

    # ---- summaries ----
    @property
    def flops(self) -> int:
        return sum(op[0] for op in self.ops)

    def flops_by_op(self) -> dict[str, int]:
        out: dict[str, int] = defaultdict(int)
        for name, op in zip(self.op_names, self.ops):
            if op[0]:
                out[name] += op[0]
        return dict(out)

    def comm_table(self) -> dict[str, dict]:
        """'mesh dim / collective' -> {count, bytes (buffers), wire_bytes (sent per rank), ranks}."""
        return {f"{label}/{kind}": dict(v) for (label, kind), v in sorted(self.collectives.items())}


# What torch's async-TP pass fuses with a collective (aten.mm, and _scaled_mm for float8), and the
# copies it looks through between them (the reassembly of a gather or scatter along a later dim,
# reshapes that copy).
_MATMULS = {"mm", "_scaled_mm"}
_CARRY = {"cat", "clone", "_reshape_copy", "view_copy", "split_with_sizes_copy"}
