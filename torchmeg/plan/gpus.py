"""What the planner knows about accelerators: data from the vendors' data sheets (dense, no
sparsity), per GPU of an 8-GPU HGX/DGX node.

  H100 SXM5 80GB  NVIDIA H100 Tensor Core GPU datasheet: 989 TFLOPS bf16, 1979 fp8, 80 GB HBM3 at
                  3.35 TB/s, NVLink 4 900 GB/s (bidirectional; 450 each way); DGX H100: 8x ConnectX-7
                  400 Gb/s = 50 GB/s per GPU between nodes.
  H200 SXM 141GB  NVIDIA H200 datasheet: same compute as H100, 141 GB HBM3e at 4.8 TB/s, NVLink 900 GB/s.
  B200 (HGX)      NVIDIA HGX B200 datasheet: 2.25 PFLOPS bf16, 4.5 fp8 per GPU, 180 GB HBM3e at 7.7 TB/s
                  (DGX B200: 1440 GB / 8), NVLink 5 1.8 TB/s (900 each way); ConnectX-7 400 Gb/s per GPU.
  H100 96GB 500W  The H100s torchtitan's published runs used (Meta's Grand Teton: "96GB HBM2e with 2.4
                  TB/sec", "the default 500W power limit"; torchtitan benchmarks/llama3_h100_202412):
                  "the actual peak TFLOPs number is between SXM and NVL, and we don't know its exact
                  value" -- taken as the middle of H100 NVL's 835 / 1671 and SXM's 989 / 1979 TFLOPS.
  A100 SXM4 80GB  NVIDIA A100 datasheet: 312 TFLOPS bf16 (no fp8), 80 GB HBM2e at 2.04 TB/s, NVLink 3
                  600 GB/s (300 each way); DGX A100: 8x ConnectX-6 200 Gb/s = 25 GB/s per GPU.
"""
from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass

from torchmeg.plan.calibrate import default_path
from torchmeg.plan.calibrated import Calibration
from torchmeg.plan.efficiency import EFFICIENCY, Efficiency


@dataclass(frozen=True)
class GPU:
    name: str
    bf16_flops: float      # dense peak, FLOP/s
    fp8_flops: float       # dense peak, FLOP/s (0: none)
    hbm_bytes: float       # memory, bytes
    hbm_bw: float          # bytes/s
    nvlink_bw: float       # bytes/s each way per GPU, inside a node
    network_bw: float      # bytes/s each way per GPU, between nodes
    gpus_per_node: int = 8
    efficiency: Efficiency = EFFICIENCY["h100"]  # measured fraction of each peak (torchmeg.plan.efficiency)
    # what this device was measured to do (torchmeg.plan.calibrated.Calibration): the predicted step
    # then comes from it, op by op, instead of the efficiencies above
    calibration: object = None
    fp32_flops: float = 0.0  # dense fp32 peak where it is not half of bf16's (a CPU: measured)

    def peak(self, dtype: str) -> float:
        """Peak FLOP/s for the recipe's compute: bf16 (also fp8's master path), fp32 as TF32 = half."""
        return {"bf16": self.bf16_flops, "fp8": self.fp8_flops or self.bf16_flops,
                "fp32": self.fp32_flops or self.bf16_flops / 2}[dtype]


GB = 1e9
GPUS = {
    "h100": GPU("H100 SXM5 80GB", 989.4e12, 1978.9e12, 80 * GB, 3.35e12, 450 * GB, 50 * GB),
    "h100-500w": GPU("H100 SXM 96GB HBM2e 500W", (835.5e12 + 989.4e12) / 2, (1671e12 + 1978.9e12) / 2, 96 * GB,
                     2.4e12, 450 * GB, 50 * GB, efficiency=EFFICIENCY["h100-500w"]),
    "h200": GPU("H200 SXM 141GB", 989.4e12, 1978.9e12, 141 * GB, 4.8e12, 450 * GB, 50 * GB,
                efficiency=EFFICIENCY["h200"]),
    "b200": GPU("B200 (HGX) 180GB", 2250e12, 4500e12, 180 * GB, 7.7e12, 900 * GB, 50 * GB,
                efficiency=EFFICIENCY["b200"]),
    "a100": GPU("A100 SXM4 80GB", 312e12, 0.0, 80 * GB, 2.04e12, 300 * GB, 25 * GB, efficiency=EFFICIENCY["a100"]),
}


def key_for_device(device_name: str) -> str | None:
    """The GPUS key for a CUDA device's name (torch.cuda.get_device_name(): "NVIDIA H100 80GB HBM3" ->
    "h100"); None for a device the table does not hold. h100-500w is left out: its device name is an
    H100's, so a plan for it is asked for by name."""
    return next((key for key in ("h100", "h200", "b200", "a100") if key.upper() in device_name), None)


def target(name: str, calibration: str = "", world: int = 1) -> GPU:
    """The device a plan is for: a GPU of the table (with a calibration file, its predicted step comes from
    what that device measured), or "cpu": this machine as calibrated (`python -m torchmeg.plan --calibrate`;
    its rates, bandwidth and links from the file, its memory the machine's RAM shared by its ranks)."""
    if name != "cpu":
        gpu = GPUS[name]
        return dataclasses.replace(gpu, calibration=Calibration.load(calibration)) if calibration else gpu
    cal = Calibration.load(calibration or default_path("cpu", world))  # (its ranks' own: one rank's rates are not two's)
    ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    links = cal.collectives.get("all_gather") or [[1.0, 1.0]]
    link_bw = max(b / t for b, t in links)
    return GPU(f"CPU {cal.name} ({cal.ranks} rank(s) x {cal.threads} threads, calibrated)", cal.best_rate("bfloat16"),
               0.0, ram / max(1, world), cal.best_bandwidth(), link_bw, link_bw, gpus_per_node=max(1, world),
               calibration=cal, fp32_flops=cal.best_rate("float32"))
