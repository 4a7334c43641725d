"""The attention backend interface and the choice between implementations."""

from __future__ import annotations

from abc import ABC, abstractmethod

import torch

from pagedserve.kernels.metadata import AttentionMetadata

BACKEND_NAMES = ("auto", "triton", "torch")


class AttentionBackend(ABC):
    """Writes new keys/values into the paged cache and attends over it (see DESIGN.md, kernel contract)."""

    name: str
    # True when a step's launches depend only on device tensors and what `prepare` planned, so a recorded
    # CUDA graph stays valid for any lengths (see engine/cuda_graphs.py).
    supports_cuda_graphs: bool = False

    def prepare(self, metadata: AttentionMetadata) -> AttentionMetadata:
        """Per-step host-side work shared by every layer; returns metadata with its `plan` filled."""
        return metadata

    def check_supported(self, dtype: torch.dtype, head_dim: int, block_size: int) -> None:  # noqa: B027
        """Raises ValueError, naming the offending value, for a shape or dtype this backend cannot run."""

    @abstractmethod
    def write_kv(
        self,
        key: torch.Tensor,
        value: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        slot_mapping: torch.Tensor,
    ) -> None: ...

    @abstractmethod
    def paged_attention(
        self,
        query: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        metadata: AttentionMetadata,
        scale: float,
    ) -> torch.Tensor: ...


def resolve_backend_name(name: str, device: torch.device) -> str:
    if name not in BACKEND_NAMES:
        raise ValueError(f"attention_backend must be one of {BACKEND_NAMES}, got {name!r}")
    if name == "auto":
        return "triton" if device.type == "cuda" else "torch"
    return name


def get_backend(name: str = "auto", device: torch.device | str = "cpu") -> AttentionBackend:
    resolved = resolve_backend_name(name, torch.device(device))
    if resolved == "triton":
        from pagedserve.kernels.triton_backend import TritonBackend

        return TritonBackend()
    from pagedserve.kernels.torch_backend import TorchBackend

    return TorchBackend()
