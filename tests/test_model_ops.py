"""Model building blocks equal Hugging Face's formulas exactly (the fused ops must not drift)."""

from __future__ import annotations

import pytest
import torch

from phaselab.model.llama import RMSNorm


def hf_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """transformers' LlamaRMSNorm.forward, written out."""
    h = x.to(torch.float32)
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * h.to(x.dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows,scale", [(1, 1.0), (7, 1e-3), (512, 50.0)])
def test_rms_norm_is_bit_identical_to_transformers(dtype, rows, scale):
    g = torch.Generator().manual_seed(rows)
    norm = RMSNorm(576, 1e-5).to(dtype)
    with torch.no_grad():
        norm.weight.copy_(torch.randn(576, generator=g))
    x = (torch.randn(rows, 576, generator=g) * scale).to(dtype)
    with torch.inference_mode():
        got = norm(x)
    want = hf_rms_norm(x, norm.weight.detach(), 1e-5)
    assert got.dtype == dtype and torch.equal(got, want)
