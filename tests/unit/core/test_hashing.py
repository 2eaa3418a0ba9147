"""qwz.param_hash: canonical parameter hashes."""

from __future__ import annotations

import math

import torch
from hypothesis import given
from hypothesis import strategies as st

import qwz

from .single_rank import named_shapes

# --------------------------------------------------------------------------- #
# qwz.param_hash
# --------------------------------------------------------------------------- #


class Holder(torch.nn.Module):
    """Parameters registered in a given order, optionally as views into one flat buffer."""

    def __init__(self, named: list[tuple[str, torch.Tensor]], *, flat_views: bool = False):
        super().__init__()
        flat = torch.cat([tensor.reshape(-1) for _, tensor in named]) if flat_views else None
        self.flat = flat
        offset = 0
        for name, tensor in named:
            param = torch.nn.Parameter(tensor.clone())
            if flat is not None:
                param.data = flat[offset : offset + tensor.numel()].view(tensor.shape)
                offset += tensor.numel()
            self.register_parameter(name, param)


@st.composite
def named_tensors(draw) -> list[tuple[str, torch.Tensor]]:
    """1 to 5 named fp32 tensors whose values are bf16-representable."""
    generator = torch.Generator().manual_seed(draw(st.integers(0, 2**31)))
    named = []
    for name, shape in draw(named_shapes(min_dim=1, min_count=1)):
        named.append((name, torch.randn(shape, generator=generator).to(torch.bfloat16).float()))
    return named


@given(named=named_tensors(), data=st.data())
def test_param_hash_ignores_registration_order_and_flat_views(named, data):
    shuffled = data.draw(st.permutations(named))
    plain = Holder(named)
    views = Holder(shuffled, flat_views=True)
    assert views.flat is not None
    flat_storage = views.flat.untyped_storage().data_ptr()
    assert all(p.untyped_storage().data_ptr() == flat_storage for p in views.parameters())
    assert qwz.param_hash(plain) == qwz.param_hash(views)


@given(named=named_tensors(), data=st.data())
def test_param_hash_changes_with_one_ulp(named, data):
    index = data.draw(st.integers(0, len(named) - 1))
    name, tensor = named[index]
    element = data.draw(st.integers(0, tensor.numel() - 1))
    nudged = tensor.clone().reshape(-1)
    nudged[element] = torch.nextafter(nudged[element], torch.tensor(math.inf))
    changed = [*named[:index], (name, nudged.view(tensor.shape)), *named[index + 1 :]]
    assert qwz.param_hash(Holder(named)) != qwz.param_hash(Holder(changed))


@given(named=named_tensors())
def test_param_hash_tells_bf16_from_fp32_copies(named):
    bf16 = [(name, tensor.to(torch.bfloat16)) for name, tensor in named]
    assert all(torch.equal(a.float(), b) for (_, a), (_, b) in zip(bf16, named, strict=True))
    assert qwz.param_hash(Holder(named)) != qwz.param_hash(Holder(bf16))
