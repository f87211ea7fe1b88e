"""The suite's one rule for comparing two runs or an implementation with its reference (relative
bounds from the number format), and the `parity` marker that finds the tests using it."""
from __future__ import annotations

import inspect
import re

# ---- run-vs-run comparisons: one rule ---------------------------------------------------------
# Every bound is RELATIVE to the compared value's magnitude: floating point rounds relative to size,
# so an absolute bound on a loss of 6 or a grad norm of 10 tests the machine, not the feature (an
# absolute 1e-5 on a grad norm of 10.3 failed on an AVX2-only EPYC at 1.1e-6 relative).
#
# FP32_PARITY = 1e-5 ~ 168 u with u = 2^-24 (fp32 unit roundoff). Two fp32 runs that differ only in the
# order of their reductions (sharded sums, a tree all-reduce, another ISA's FMA/blocking, a resharded
# optimizer) differ by ~sqrt(n) u per n-term sum; Adam renormalises each update, so over the <= 20
# steps of a parity run the runs drift by a few tens of u (measured: <= 2e-6 relative on AVX-512 and
# AVX2). 168 u leaves room for that drift and still fails on any real change: a layout that drops one
# microbatch or mis-shards one weight moves the loss by >= 1e-3 relative at the first step.
FP32_PARITY = 1e-5
# bf16 carries 8 significant bits: unit roundoff 2^-8.
BF16_U = 2.0 ** -8


def rel_diff(a: float, b: float) -> float:
    """|a - b| relative to the larger magnitude (0 when both are 0)."""
    scale = max(abs(a), abs(b))
    return abs(a - b) / scale if scale else 0.0


def assert_close(a: float, b: float, rtol: float = FP32_PARITY, what: str = "") -> None:
    assert rel_diff(a, b) <= rtol, f"{what}: {a!r} vs {b!r} (relative {rel_diff(a, b):.2e} > {rtol:.1e})"


def assert_tensor_close(a, b, rtol: float = FP32_PARITY, what: str = "") -> None:
    """Element-wise difference relative to the tensors' largest magnitude (the scale every element's
    rounding is taken at in a matmul or a sum); refuses to compare zeros."""
    a, b = a.detach().double(), b.detach().double()
    scale = max(a.abs().max().item(), b.abs().max().item())
    assert scale > 0, f"{what}: comparing zeros"
    d = (a - b).abs().max().item()
    assert d <= rtol * scale, f"{what}: max difference {d:.3e} > {rtol:.1e} x scale {scale:.3e}"


DEFAULT_KEYS = ("loss", "grad_norm", "val_loss")


def assert_parity(ref: list[dict], got: list[dict], rtol: float = FP32_PARITY, keys: tuple | None = None,
                  steps=None) -> None:
    """Per-step metrics of a layout vs the reference run, every key relative (the rule above).
    `steps`: compare only these steps (both runs must log them). `keys` (default loss, grad norm and
    val_loss where validation ran): each key named must be logged at some compared step, so that a
    key whose feature is off (validation never enabled, say) is not taken as compared."""
    if steps is not None:
        ref = [r for r in ref if r["step"] in steps]
        got = [r for r in got if r["step"] in steps]
    assert [r["step"] for r in got] == [r["step"] for r in ref], "different steps logged"
    assert ref, "nothing to compare"
    named, keys = keys is not None, DEFAULT_KEYS if keys is None else keys
    for k in keys if named else ("loss",):
        assert any(k in r for r in ref), f"{k!r} is logged at none of the steps compared: nothing of it is compared"
    for a, b in zip(ref, got):
        for k in keys:
            assert (k in a) == (k in b), f"step {a['step']}: {k} in only one run"
            if k in a:
                assert_close(a[k], b[k], rtol, f"step {a['step']} {k} (reference vs layout)")


# ---- the `parity` marker: every test that compares by the rule above ---------------------------
# Found, not hand-kept: a test is a parity test when it (or a helper of its module that it calls)
# uses one of the rule's helpers. `.ci/run` runs these again under an AVX2 cap (ATen, oneDNN and
# MKL), so a bound fitted to this machine's ISA fails in CI, not on a user's CPU.
_RULE_NAMES = ("assert_parity", "assert_close", "assert_tensor_close", "FP32_PARITY", "BF16_U", "rel_diff")
_RULE_WORD = re.compile(r"\b(?:" + "|".join(_RULE_NAMES) + r")\b")


def uses_rule(fn, module, depth: int = 1) -> bool:
    """Whether test function `fn` names one of the rule's helpers or constants, or calls a function
    of its own module (`depth` levels down) that does."""
    try:
        src = inspect.getsource(fn)
    except (OSError, TypeError):
        return False
    # whole words: a result field such as `loss_rel_diff` is not the rule's `rel_diff` (it made
    # tools/gpu_check's dry run, a compile-vs-eager bench, a parity test, rerun under the AVX2 cap)
    if _RULE_WORD.search(src):
        return True
    helpers = {assert_parity, assert_close, assert_tensor_close, rel_diff}
    for name in set(re.findall(r"\b([A-Za-z_]\w*)\(", src)):
        obj = getattr(module, name, None)
        if obj in helpers:
            return True
        if depth and inspect.isfunction(obj) and obj.__module__ == module.__name__ and obj is not fn \
                and uses_rule(obj, module, depth - 1):
            return True
    return False
