"""The op recorder (TORCHMEG_RECORD_OPS, torchmeg.observe.op_record) records what ran, not what a
wrapper says: found on an H200 (torch 2.11, 2026-11-29), where a bf16 run recorded flex attention's
backward as "bfloat16, float32" (its float32 log-sum-exp taken for an operand) and a float8 run
recorded its float8 matmuls as a bf16 `mm` (torchao's training tensor says bfloat16 and holds
float8). Both shown here on the CPU, in process."""
from __future__ import annotations

import pytest
import torch

from torchmeg.observe.op_record import OpRecorder
from conftest import assert_tensor_close


@pytest.mark.parametrize("emulate, want", [(False, {"_scaled_mm": ["float8_e4m3fn", "float8_e5m2"]}),
                                           (True, {"mm": ["float32"]})])
def test_float8_matmuls_are_recorded_as_they_ran(emulate, want):
    """torchao's float8 Linear, forward and backward. Real float8 (emulate = false: torch's CPU
    `_scaled_mm` runs here as on a GPU) is recorded as `_scaled_mm` on e4m3 / e5m2 operands (the scales,
    float32, are not operands); emulated, as the float32 `mm` of the dequantized data. Never as the
    wrapper's bfloat16 `mm` (what the recorder said before)."""
    import torch.nn.attention.flex_attention as flex_module
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 64, bias=False)).to(torch.bfloat16)
    convert_to_float8_training(model, config=Float8LinearConfig(emulate=emulate))
    x = torch.randn(16, 64, dtype=torch.bfloat16, requires_grad=True)
    flag = flex_module._FLEX_ATTENTION_DISABLE_COMPILE_DEBUG
    recorder = OpRecorder()
    with recorder:
        model(x).sum().backward()
    assert {k: sorted(v) for k, v in recorder.matmul.items()} == want, recorder.matmul
    assert {"float8_e4m3fn", "float8_e5m2"} <= recorder.seen, recorder.seen
    assert flex_module._FLEX_ATTENTION_DISABLE_COMPILE_DEBUG == flag  # (entered twice: put back once, as it was)
    report = recorder.report(model)
    assert report["float8_modules"] == ["0"] and x.grad is not None and model[0].weight.grad is not None


def test_flex_attention_backward_is_recorded_by_its_operands():
    """Flex attention forward and backward as a recorded GPU step runs them (the op itself, not our
    compiled kernel; on the CPU flex's own wrapper refuses a backward, so the op is called directly):
    bf16 q, k, v record as bf16 although its backward also takes the float32 log-sum-exp; and the
    recorded op's gradients equal SDPA's with the same document mask (bf16: 8 mantissa bits, sums of
    64 terms -> a few 2^-8)."""
    from torch._higher_order_ops.flex_attention import flex_attention as flex_op
    from torchmeg.models.flex_documents import document_block_mask
    torch.manual_seed(0)
    B, H, L, D = 1, 4, 64, 16
    q, k, v = (torch.randn(B, H, L, D, dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
    docs = torch.tensor([[0] * 20 + [1] * 30 + [2] * 14])
    recorder = OpRecorder()
    with recorder:
        out, _, _ = flex_op(q, k, v, lambda score, b, h, i, j: score, document_block_mask(docs, L).as_tuple(),
                            D ** -0.5, {"BACKEND": "AUTO", "OUTPUT_LOGSUMEXP": True, "OUTPUT_MAX": False})
        out.float().square().sum().backward()
    assert {k: sorted(v) for k, v in recorder.matmul.items()} == {
        "flex_attention": ["bfloat16"], "flex_attention_backward": ["bfloat16"]}, recorder.matmul
    assert "float32" in recorder.seen  # (the log-sum-exp: seen, not an operand)
    got = [t.grad.float() for t in (q, k, v)]
    ref = [t.detach().float().requires_grad_() for t in (q, k, v)]
    mask = (docs[0][:, None] == docs[0][None, :]) & torch.ones(L, L, dtype=torch.bool).tril()
    want = torch.nn.functional.scaled_dot_product_attention(*ref, attn_mask=mask)
    want.square().sum().backward()
    assert_tensor_close(out.float(), want, 2 ** -8 * 4, "recorded flex output vs SDPA")
    for g, r, name in zip(got, ref, "qkv"):
        assert_tensor_close(g, r.grad, 2 ** -8 * 8, f"recorded flex d{name} vs SDPA")
