"""What fraction of a GPU's data-sheet peak each class of kernel reaches, from public measurements.

The planner's "predicted" step time divides each op's work by peak x efficiency (torchmeg.plan.predict);
the "upper bound" keeps efficiency 1. Each per-class number is one kernel-level measurement; the one
end-to-end factor (END_TO_END, below) is measured on one published training run, and the prediction
is checked against three others (tests/test_plan_predict.py, torchtitan's Llama 3.1 8B rows).

matmul bf16 / fp8   Maximum Achievable Matmul FLOPS (MAMF, mean of 100 runs at the best shape found),
                    S. Bekman, "Machine Learning Engineering", compute/accelerator/README.md
                    (github.com/stas00/ml-engineering): A100 SXM 271.2 of 312 TFLOPS (86.9%), H100 SXM
                    794.5 of 989 (80.3%; "H200 is the same"), B200 1745 of 2250 (77.6%); fp8 H100 1402.6
                    of 1979 (70.9%), H200 1453.4 (73.4%), B200 3432.5 of 4500 (76.3%). fp32 matmuls (TF32)
                    take bf16's fraction of the TF32 peak (no published TF32 MAMF).
attention           torch's flash SDPA kernel is FlashAttention-2: "FlashAttention-2 achieving only 35%
                    utilization on the H100 GPU" (Shah et al., FlashAttention-3, arXiv 2407.08608,
                    abstract); on A100 "50-73% of the theoretical maximum FLOPs/s" (Dao,
                    FlashAttention-2, arXiv 2307.08691, abstract): the middle, 61.5%. B200 has no
                    published FA2 figure: Hopper's is used. Causal attention skips the masked half of
                    the tiles, so its time counts half the FLOPs (flop_counter counts all).
memory              elementwise ops, norms, reductions, the optimizer: HBM at the rate a device-to-device
                    copy reaches, 2,903 of 3,350 GB/s on H100 SXM (86.7%; Voltage Park / AI @ Georgia
                    Tech, github.com/aigatech/vpbenchmarking); the same fraction for the other parts.
links               collectives at 80% of the link's one-way rate: NCCL all-reduce 235 of 300 GB/s on
                    A100 NVLink ("~80% of the theoretical spec ... holds on newer hardware too": H200
                    pairwise copy 396 of 450 GB/s; ml-engineering network/README.md); H100 NVLink p2p
                    380 of 450 GB/s (github.com/NVIDIA/nccl/issues/1264).

end to end         what no kernel benchmark shows -- kernels slowed by the collectives that share their SMs
                    and memory, shapes far from MAMF's best one, launch gaps, clocks under sustained
                    load -- taken as one factor on the compute time, measured once on a published run that
                    is not among those the prediction is checked against: Trainy's Llama 3.1 8B, FSDP 32,
                    compile + float8, local batch 2, torchtitan's per-op recompute, on 32 H200 at 10,938
                    tokens/s per GPU (torchtitan benchmarks/llama3-8b_h200_202506_trainy-whitefiber.md):
                    a step of 16,384 / 10,938 = 1.498 s where the kernel-level compute sums to 1.138 s
                    (its FSDP traffic, 1.17 s at 80% of 400 Gb/s, hides under it): 1.138 / 1.498 = 0.76.
                    `python tools/plan_vs_published.py` prints that row and the held-out ones
                    (torchtitan's 8B eager / compile / float8 on H100), which tests/test_plan_predict.py
                    checks within 15%. A plan with a calibration (python -m torchmeg.plan --calibrate on the
                    device; --calibration FILE) uses neither these efficiencies nor this factor: every op
                    is priced from what that device measured (torchmeg.plan.calibrated).
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Efficiency:
    matmul_bf16: float
    matmul_fp8: float
    attention: float
    memory: float
    links: float

    def matmul(self, kind: str) -> float:
        return self.matmul_fp8 if kind == "fp8" else self.matmul_bf16


END_TO_END = 0.76  # kernel-level compute time / published step on the calibration run above

_HOPPER = Efficiency(matmul_bf16=0.803, matmul_fp8=0.709, attention=0.35, memory=0.867, links=0.80)
EFFICIENCY = {
    "h100": _HOPPER,
    "h100-500w": _HOPPER,
    "h200": Efficiency(matmul_bf16=0.803, matmul_fp8=0.734, attention=0.35, memory=0.867, links=0.80),
    "b200": Efficiency(matmul_bf16=0.776, matmul_fp8=0.763, attention=0.35, memory=0.867, links=0.80),
    "a100": Efficiency(matmul_bf16=0.869, matmul_fp8=0.869, attention=0.615, memory=0.867, links=0.78),
}
