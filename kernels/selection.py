"""Which kernel backend runs: by name, or `auto` for the device (Triton on CUDA, the C kernels on the CPU)."""

from __future__ import annotations

import torch

from pagedserve.kernels.backend import KernelBackend

BACKEND_NAMES = ("auto", "triton", "cpu")
DEPRECATED_NAMES = {"torch": "cpu"}  # the CPU backend's former name, so that older configs keep working


def resolve_backend_name(name: str, device: torch.device) -> str:
    name = DEPRECATED_NAMES.get(name, name)
    if name not in BACKEND_NAMES:
        raise ValueError(f"attention_backend must be one of {BACKEND_NAMES}, got {name!r}")
    if name == "auto":
        return "triton" if device.type == "cuda" else "cpu"
    return name


def get_backend(name: str = "auto", device: torch.device | str = "cpu") -> KernelBackend:
    resolved = resolve_backend_name(name, torch.device(device))
    if resolved == "triton":
        from pagedserve.kernels.triton_backend import TritonBackend

        return TritonBackend()
    from pagedserve.kernels.cpu_backend import CpuBackend

    return CpuBackend()
