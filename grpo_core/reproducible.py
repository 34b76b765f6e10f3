"""One switch for a reproducible run on one machine: the same command gives the same completions and the same bits at
every step (`GRPOCoreTrainer(reproducible=True)` calls `make_reproducible`), and the settings in force, recorded with
every step file so that a diff names the ones two runs do not share.

What makes two runs of one command differ on a GPU, and what the switch sets against it:
- attention kernels whose results depend on scheduling: cuDNN's scaled-dot-product attention (its forward gave other
  sampled ids between two calls with the same seed on an H100) is turned off, and the flash / memory-efficient
  backward passes take their deterministic algorithms (`torch.use_deterministic_algorithms(True)`, which also makes
  every other op with a non-deterministic kernel raise instead of drifting);
- cuBLAS's workspace: `CUBLAS_WORKSPACE_CONFIG=:4096:8` unless set (deterministic algorithms need it);
- cuDNN's autotuner: `cudnn.benchmark = False`, `cudnn.deterministic = True`;
- the random generators: the trainer seeds them with its `seed` (transformers' `Trainer` does, whatever the switch).
It does not set `CUDA_LAUNCH_BLOCKING` (transformers' `enable_full_determinism` does, and every kernel launch then
waits for the one before it): launches stay asynchronous. The settings are process-wide, as torch's are.
"""

from __future__ import annotations

import os
from typing import Any

import torch

__all__ = ["determinism_settings", "make_reproducible"]

WORKSPACE = ":4096:8"
_WORKSPACES = (":4096:8", ":16:8")  # the two values torch's deterministic check accepts


def make_reproducible() -> None:
    """Sets what a reproducible run needs (module docstring); `CUBLAS_WORKSPACE_CONFIG` set to another value than the
    two deterministic ones raises."""
    workspace = os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", WORKSPACE)
    if workspace not in _WORKSPACES:
        raise ValueError(f"CUBLAS_WORKSPACE_CONFIG: expected {' or '.join(_WORKSPACES)} (or unset) for a "
                         f"reproducible run, got {workspace!r}")
    os.environ["FLASH_ATTENTION_DETERMINISTIC"] = "1"  # the flash-attn package's backward, when a model uses it
    torch.use_deterministic_algorithms(True)
    torch.backends.cudnn.deterministic = True
    torch.backends.cudnn.benchmark = False
    torch.backends.cuda.enable_cudnn_sdp(False)


def determinism_settings() -> dict[str, Any]:
    """The process's settings that decide whether a run repeats and which kernels compute it."""
    b = torch.backends
    return {"deterministic_algorithms": torch.are_deterministic_algorithms_enabled(),
            "deterministic_warn_only": torch.is_deterministic_algorithms_warn_only_enabled(),
            "cudnn_deterministic": b.cudnn.deterministic, "cudnn_benchmark": b.cudnn.benchmark,
            "sdp_cudnn": b.cuda.cudnn_sdp_enabled(), "sdp_flash": b.cuda.flash_sdp_enabled(),
            "sdp_mem_efficient": b.cuda.mem_efficient_sdp_enabled(), "sdp_math": b.cuda.math_sdp_enabled(),
            "tf32_matmul": b.cuda.matmul.allow_tf32, "tf32_cudnn": b.cudnn.allow_tf32,
            "bf16_reduced_precision_reduction": b.cuda.matmul.allow_bf16_reduced_precision_reduction,
            "cublas_workspace_config": os.environ.get("CUBLAS_WORKSPACE_CONFIG"),
            "cuda_launch_blocking": os.environ.get("CUDA_LAUNCH_BLOCKING")}
