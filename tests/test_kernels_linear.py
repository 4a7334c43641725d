"""The CPU skinny linear kernel (kernels/cpu_linear.py) against torch's matmul, and where the CPU backend uses it."""

from __future__ import annotations

import shutil

import pytest
import torch

from pagedserve.kernels.cpu_backend import CpuBackend
from pagedserve.kernels.cpu_linear import MAX_ROWS, MIN_ROWS, SkinnyLinear, skinny_linear_applies, skinny_linear_kernel

pytestmark = pytest.mark.skipif(shutil.which("cc") is None, reason="needs a C compiler")


@pytest.fixture(scope="module")
def kernel() -> SkinnyLinear:
    built = skinny_linear_kernel()
    assert built is not None, "the kernel must build wherever a C compiler is installed"
    return built


# Token counts around each vector (8) and tile (16) boundary; output rows around the 6-row tile.
@pytest.mark.parametrize("tokens", [1, 7, 8, 9, 16, 20, 33, 64])
@pytest.mark.parametrize(("out_features", "in_features"), [(12, 40), (13, 8), (5, 33), (96, 576)])
@pytest.mark.parametrize("with_bias", [False, True])
def test_matches_torch(kernel: SkinnyLinear, tokens: int, out_features: int, in_features: int, with_bias: bool) -> None:
    generator = torch.Generator().manual_seed(tokens * 1000 + out_features)
    x = torch.randn(in_features, tokens, generator=generator).t()  # feature-major, as the layers pass it
    weight = torch.randn(out_features, in_features, generator=generator)
    bias = torch.randn(out_features, generator=generator) if with_bias else None
    out = kernel(x, weight, bias)
    # float32 sums of up to 576 terms, added in another order than MKL's: a few ulp of the sum apart
    torch.testing.assert_close(out, torch.nn.functional.linear(x, weight, bias), rtol=1e-5, atol=1e-4)
    assert out.shape == (tokens, out_features) and out.stride(0) == 1, "feature-major out"


def test_token_major_and_padded_inputs(kernel: SkinnyLinear) -> None:
    generator = torch.Generator().manual_seed(0)
    weight = torch.randn(30, 24, generator=generator)
    for x in (
        torch.randn(19, 24, generator=generator),  # token-major: the kernel transposes a copy
        torch.randn(24, 25, generator=generator).t()[:19],  # feature-major inside a wider buffer
    ):
        torch.testing.assert_close(
            kernel(x, weight, None), x @ weight.t(), rtol=1e-5, atol=1e-4
        )  # float32 sums of up to 576 terms, in another order


def test_applies_only_to_float32_cpu_batches_in_range() -> None:
    weight = torch.randn(8, 8)
    assert skinny_linear_applies(torch.randn(MIN_ROWS, 8), weight)
    assert skinny_linear_applies(torch.randn(MAX_ROWS, 8), weight)
    assert not skinny_linear_applies(torch.randn(MIN_ROWS - 1, 8), weight)
    assert not skinny_linear_applies(torch.randn(MAX_ROWS + 1, 8), weight)
    assert not skinny_linear_applies(torch.randn(16, 8, dtype=torch.bfloat16), weight.bfloat16())
    assert not skinny_linear_applies(torch.randn(16, 8, requires_grad=True), weight)


def test_cpu_backend_routes_decode_batches_through_it(kernel: SkinnyLinear) -> None:
    calls: list[int] = []

    def counted(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        calls.append(x.shape[0])
        return kernel(x, weight, bias)

    backend = CpuBackend()
    assert backend.skinny_linear is kernel
    backend.skinny_linear = counted
    x = torch.randn(16, 32)
    weight, bias = torch.randn(48, 32), torch.randn(48)
    torch.testing.assert_close(
        backend.linear(x, weight, bias), torch.nn.functional.linear(x, weight, bias), rtol=1e-5, atol=1e-4
    )  # float32 sums of up to 576 terms, in another order
    backend.linear(torch.randn(MAX_ROWS + 1, 32), weight, bias)  # past the kernel's range: torch's matmul
    assert calls == [16]
    assert CpuBackend(native=False).skinny_linear is None  # without native kernels, torch's matmul only


@pytest.mark.parametrize(
    "weight, bias",
    [
        (torch.randn(8, 12)[:, :10], None),  # not contiguous
        (torch.randn(8, 9), None),  # wrong input width
        (torch.randn(8, 10), torch.randn(7)),  # wrong bias length
        (torch.randn(8, 10), torch.randn(8, dtype=torch.float64)),  # wrong bias dtype
    ],
)
def test_arguments_the_kernel_would_misread_are_refused(kernel: SkinnyLinear, weight, bias) -> None:
    with pytest.raises(ValueError):
        kernel(torch.randn(16, 10), weight, bias)
