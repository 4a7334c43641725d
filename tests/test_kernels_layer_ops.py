"""The fused CPU layer ops (kernels/cpu_layer_ops.py) against the torch code they replace, in both layouts, and
the CPU backend's dense ops that route to them against the base class's torch defaults."""

from __future__ import annotations

import shutil
from collections.abc import Callable

import pytest
import torch
import torch.nn.functional as F

from pagedserve.engine.worker.models.layers import GatedMLP, RMSNorm, RotaryEmbedding
from pagedserve.kernels.backend import KernelBackend, rms_norm, rotate_half
from pagedserve.kernels.cpu_backend import TRANSPOSED_GEMM_MAX_ROWS, CpuBackend
from pagedserve.kernels.cpu_layer_ops import LayerOps, layer_ops

pytestmark = pytest.mark.skipif(shutil.which("cc") is None, reason="needs a C compiler")

TOKEN_COUNTS = [1, 3, 32, 75, 300]  # 75: not a multiple of a vector or a tile; 300: above the threshold to thread


@pytest.fixture(scope="module")
def ops() -> LayerOps:
    built = layer_ops()
    assert built is not None, "the layer ops must build wherever a C compiler is installed"
    return built


def token_major(tokens: int, features: int, generator: torch.Generator) -> torch.Tensor:
    return torch.randn(tokens, features, generator=generator)


def feature_major(tokens: int, features: int, generator: torch.Generator) -> torch.Tensor:
    return torch.randn(features, tokens, generator=generator).t()


def padded_feature_major(tokens: int, features: int, generator: torch.Generator) -> torch.Tensor:
    """Feature-major inside a wider buffer: runs of tokens are not back to back."""
    return torch.randn(features, tokens + 5, generator=generator).t()[:tokens]


LAYOUTS: dict[str, Callable[[int, int, torch.Generator], torch.Tensor]] = {
    "token-major": token_major,
    "feature-major": feature_major,
}


def same_layout(x: torch.Tensor, y: torch.Tensor) -> bool:
    return x.stride() == y.stride()


@pytest.mark.parametrize("tokens", TOKEN_COUNTS)
@pytest.mark.parametrize("layout", [*LAYOUTS, "padded feature-major"])
def test_silu_and_mul_matches_torch(ops: LayerOps, tokens: int, layout: str) -> None:
    make = LAYOUTS.get(layout, padded_feature_major)
    gate_up = make(tokens, 2 * 40, torch.Generator().manual_seed(tokens)) * 6
    gate_up[0, :4] = torch.tensor([0.0, -0.0, 90.0, -90.0])  # zero, and far past where exp over/underflows
    gate, up = gate_up.split(40, dim=-1)
    out = ops.silu_and_mul(gate_up)
    torch.testing.assert_close(out, F.silu(gate) * up, rtol=2e-6, atol=1e-6)
    assert out.shape == (tokens, 40)
    assert tokens == 1 or (layout == "token-major") == (out.stride(-1) == 1), "out keeps the input's layout"


@pytest.mark.parametrize("tokens", TOKEN_COUNTS)
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("with_delta", [False, True])
def test_add_rms_norm_matches_torch(ops: LayerOps, tokens: int, layout: str, with_delta: bool) -> None:
    generator = torch.Generator().manual_seed(tokens)
    hidden = LAYOUTS[layout](tokens, 96, generator) * 3
    delta = LAYOUTS[layout](tokens, 96, generator) if with_delta else None
    weight = torch.randn(96, generator=generator)
    total = hidden + delta if delta is not None else hidden.clone()
    expected = weight * (total * torch.rsqrt(total.pow(2).mean(-1, keepdim=True) + 1e-6))
    out = ops.add_rms_norm(hidden, delta, weight, 1e-6)
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)
    assert torch.equal(hidden, total), "the residual add is exact and lands in hidden"
    assert same_layout(out, hidden)


def test_add_rms_norm_takes_a_delta_in_the_other_layout(ops: LayerOps) -> None:
    generator = torch.Generator().manual_seed(0)
    hidden, delta = feature_major(20, 64, generator), token_major(20, 64, generator)
    total = hidden + delta
    weight = torch.ones(64)
    out = ops.add_rms_norm(hidden, delta, weight, 1e-5)
    torch.testing.assert_close(out, total * torch.rsqrt(total.pow(2).mean(-1, keepdim=True) + 1e-5))
    assert torch.equal(hidden, total)


@pytest.mark.parametrize("tokens", TOKEN_COUNTS)
@pytest.mark.parametrize("layout", LAYOUTS)
def test_rotary_matches_torch(ops: LayerOps, tokens: int, layout: str) -> None:
    """Query and key as views of one fused qkv activation, as the attention layer has them."""
    heads, kv_heads, head_dim = 4, 2, 16
    generator = torch.Generator().manual_seed(tokens)
    qkv = LAYOUTS[layout](tokens, (heads + 2 * kv_heads) * head_dim, generator)
    query = qkv[:, : heads * head_dim].view(tokens, heads, head_dim)
    key = qkv[:, heads * head_dim : (heads + kv_heads) * head_dim].view(tokens, kv_heads, head_dim)
    rotary = RotaryEmbedding(head_dim, 4096, {"rope_theta": 10000.0}, None)
    angles = rotary.angles(torch.randint(0, 4096, (tokens,), generator=generator))
    expected = [x * angles.cos[:, None] + rotate_half(x) * angles.sin[:, None] for x in (query, key)]
    value_before = qkv[:, (heads + kv_heads) * head_dim :].clone()
    rotated = CpuBackend().rotary(angles, query, key)
    assert rotated[0].data_ptr() == query.data_ptr(), "rotated in place, in the qkv activation"
    for got, want in zip(rotated, expected, strict=True):
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
    assert torch.equal(qkv[:, (heads + kv_heads) * head_dim :], value_before), "values are left alone"


def test_rms_norm_module_uses_the_fused_op_in_place(ops: LayerOps) -> None:
    norm = RMSNorm(32, 1e-6, CpuBackend())
    with torch.no_grad():
        norm.weight.copy_(torch.linspace(0.5, 1.5, 32))
    generator = torch.Generator().manual_seed(1)
    residual, delta = feature_major(8, 32, generator), feature_major(8, 32, generator)
    expected_sum = residual + delta
    expected = rms_norm(expected_sum, norm.weight, norm.eps)
    with torch.inference_mode():
        out, stream = norm.add_and_forward(delta, residual)
    assert stream is residual and torch.equal(stream, expected_sum)
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)


def test_gated_mlp_matches_the_torch_path(ops: LayerOps) -> None:
    torch.manual_seed(0)
    mlp, reference = GatedMLP(24, 40, CpuBackend()), GatedMLP(24, 40, CpuBackend(native=False))
    reference.load_state_dict(mlp.state_dict())
    x = torch.randn(6, 24)
    with torch.inference_mode():
        torch.testing.assert_close(mlp(x), reference(x), rtol=1e-5, atol=1e-6)


# Token counts on both sides of the transposed-GEMM limit: feature-major outputs up to it, token-major past it.
@pytest.mark.parametrize("tokens", [1, 16, 75, TRANSPOSED_GEMM_MAX_ROWS, TRANSPOSED_GEMM_MAX_ROWS + 1])
def test_cpu_dense_ops_match_the_torch_defaults(ops: LayerOps, tokens: int) -> None:
    """Each dense op the CPU backend overrides computes what the base class's torch default (CUDA's) does."""
    backend, generator = CpuBackend(), torch.Generator().manual_seed(tokens)
    x, weight, bias = (torch.randn(shape, generator=generator) for shape in ((tokens, 48), (80, 48), (80,)))
    with torch.inference_mode():
        out = backend.linear(x, weight, bias)
        torch.testing.assert_close(out, KernelBackend.linear(backend, x, weight, bias), rtol=1e-5, atol=1e-4)
        hidden = backend.in_linear_output_layout(torch.randn(tokens, 80, generator=generator))
        if tokens > 1:  # one token is both layouts at once
            assert (out.stride(0) == 1) == (tokens <= TRANSPOSED_GEMM_MAX_ROWS), "feature-major for small batches"
            assert hidden.stride() == out.stride(), "the residual stream shares the projections' layout"
        norm_weight = torch.randn(80, generator=generator)
        torch.testing.assert_close(
            backend.rms_norm(out, norm_weight, 1e-6), KernelBackend.rms_norm(backend, out, norm_weight, 1e-6)
        )
        expected_norm, expected_sum = KernelBackend.add_rms_norm(backend, out, hidden, norm_weight, 1e-6)
        normed, residual = backend.add_rms_norm(out, hidden, norm_weight, 1e-6)
        torch.testing.assert_close(normed, expected_norm)
        assert residual is hidden and torch.equal(residual, expected_sum), "the sum lands in the residual"
        torch.testing.assert_close(backend.silu_and_mul(out), KernelBackend.silu_and_mul(backend, out))


def test_autograd_inputs_keep_the_torch_path() -> None:
    norm = RMSNorm(16, 1e-6, CpuBackend())
    x = torch.randn(4, 16, requires_grad=True)
    norm(x).sum().backward()  # the fused op would bypass autograd; the torch path keeps gradients flowing
    assert x.grad is not None


@pytest.mark.parametrize(
    "call",
    [
        lambda ops: ops.add_rms_norm(torch.randn(4, 8)[:, ::2], None, torch.ones(4), 1e-6),  # strided features
        lambda ops: ops.silu_and_mul(torch.randn(4, 6, 8)),  # not [tokens, features]
        lambda ops: ops.rotary(torch.randn(4, 2, 8), torch.ones(4, 3), torch.ones(4, 3)),  # tables too narrow
    ],
)
def test_layouts_the_kernels_would_misread_are_refused(ops: LayerOps, call) -> None:
    with pytest.raises(ValueError):
        call(ops)


def test_rms_norm_module_takes_activations_the_fused_op_does_not(ops: LayerOps) -> None:
    norm = RMSNorm(16, 1e-6, CpuBackend())
    strided = torch.randn(6, 32)[:, ::2]  # neither layout: the torch path runs
    delta = torch.randn(6, 16)
    with torch.inference_mode():
        torch.testing.assert_close(norm(strided), rms_norm(strided, norm.weight, norm.eps))
        out, stream = norm.add_and_forward(delta, strided)
    torch.testing.assert_close(stream, strided + delta)
    torch.testing.assert_close(out, rms_norm(strided + delta, norm.weight, norm.eps))
