"""qwz.param_hash: canonical parameter hashes."""

from __future__ import annotations

import hashlib
import math

import torch
from hypothesis import given
from hypothesis import strategies as st

import qwz
from qwz.hashing import tensors_hash, tensors_hashes

from .host_reads import HostReads
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


def _reference_hash(named: list[tuple[str, torch.Tensor]]) -> str:
    """The documented format, spelt out: sha256 over (name, |dtype|shape|, raw bytes) of each
    tensor in name order -- the values in the ledger and the fixtures."""
    digest = hashlib.sha256()
    for name, tensor in sorted(named, key=lambda item: item[0]):
        digest.update(f"{name}|{tensor.dtype}|{tuple(tensor.shape)}|".encode())
        digest.update(tensor.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()


@given(named=named_tensors(), data=st.data())
def test_one_pass_gives_the_whole_hash_and_each_subset_s(named, data):
    """tensors_hashes: the whole set's hash and each subset's are the documented format's,
    the same as hashing each apart, in bf16 too."""
    dtypes = st.sampled_from([torch.float32, torch.bfloat16])
    named = [(name, tensor.to(data.draw(dtypes))) for name, tensor in named]
    subsets = {name: data.draw(st.sampled_from(["dense", "expert0"])) for name, _ in named}
    whole, by_subset = tensors_hashes(named, subsets)
    assert whole == _reference_hash(named) == qwz.param_hash(Holder(named))
    assert set(by_subset) == set(subsets.values())
    for subset, value in by_subset.items():
        members = [(name, t) for name, t in named if subsets[name] == subset]
        assert value == _reference_hash(members) == tensors_hash(members), subset


def test_one_pass_reads_each_tensor_to_the_host_once():
    """Two digests (the whole set and a subset) take every tensor, from one host copy each:
    the counter of host reads (tests/unit/core/host_reads.py) sees one copy to the CPU per
    tensor, none more."""
    named = [(f"p{index}", torch.randn(5, 3)) for index in range(4)]
    with HostReads() as counter:
        tensors_hashes(named, {name: "dense" for name, _ in named})
    copies = [read for read in counter.reads if read.what == "to"]
    assert [read.where for read in copies] == ["qwz/hashing.py:_update"] * len(named)
