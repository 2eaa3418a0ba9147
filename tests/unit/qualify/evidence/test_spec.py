"""The harness's own statement of the spec: ``qwz/qualify/evidence/spec.py``.

It is tested against the rules as DESIGN.md writes them, on plain tensors, and
for its independence ([Note: the judge's independence]): nothing qwz's
implementation defines may reach it.
"""

from __future__ import annotations

import ast
import pathlib

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from qwz.qualify.evidence import spec

SPEC_PATH = pathlib.Path(spec.__file__)


def _imported_modules(path: pathlib.Path) -> set[str]:
    modules = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            modules |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom):
            modules.add("." * node.level + (node.module or ""))
    return modules


def test_the_spec_imports_nothing_from_the_code_it_judges():
    imported = _imported_modules(SPEC_PATH)
    assert imported <= {"__future__", "collections.abc", "math", "typing", "torch"}, imported
    assert not any(name.startswith((".", "qwz")) for name in imported)


def test_the_import_inspection_sees_an_import_of_the_judged_code(tmp_path):
    """The guard itself: a spec that took its scale from qwz.quant would be caught."""
    broken = tmp_path / "spec.py"
    broken.write_text(SPEC_PATH.read_text() + "\nfrom qwz.quant import scale_from_absmax\n")
    assert "qwz.quant" in _imported_modules(broken)


def test_the_scale_is_absmax_over_127_in_fp32_with_its_two_edges():
    values = torch.tensor([0.0, 0.0, 1.0, -254.0, 3e-40, 0.0, float(torch.finfo().max), 1.0])
    scales = spec.scales(values, 2)
    assert scales[0] == 0  # an all-zero group
    assert scales[1] == torch.tensor(254.0) / 127
    assert scales[2] == 2.0**-126  # a subnormal absmax: at least the smallest normal
    assert torch.isfinite(scales[3] * 127)  # the top of the fp32 range: one ulp below
    assert scales[3] == torch.nextafter(torch.tensor(torch.finfo().max) / 127, torch.tensor(0.0))


@st.composite
def groups(draw):
    group_size = draw(st.sampled_from([1, 3, 8, 64]))
    numel = draw(st.integers(1, 4 * group_size + 3))
    seed = draw(st.integers(0, 2**16))
    scale = draw(st.sampled_from([1e-30, 1e-3, 1.0, 1e30]))
    values = torch.randn(numel, generator=torch.Generator().manual_seed(seed)) * scale
    return values, group_size


@given(groups())
def test_the_decode_is_within_half_a_scale_and_codes_are_in_range(case):
    values, group_size = case
    decoded = spec.decode(values, group_size)
    scales = spec.scales(values, group_size).repeat_interleave(group_size)[: values.numel()]
    codes = torch.round(values / scales)
    assert codes.abs().max() <= spec.CODE_MAX
    # One rounding of code * scale: |x_hat - x| <= scale/2 + half an fp32 ulp of x_hat.
    slack = decoded.abs() * 2.0**-24
    assert ((decoded - values).abs() <= scales / 2 + slack).all()
    assert (decoded == codes * scales).all()


def test_near_ties_accept_either_code_and_only_there():
    scales = torch.ones(4)
    values = torch.tensor([2.5, -3.5, 2.5 + 2**-17, 2.4])  # ties, a near-tie, no tie
    nearest, other = spec.decode_alternatives(values, scales)
    assert nearest.tolist() == [2.0, -4.0, 3.0, 2.0]  # to nearest, ties to even
    assert other.tolist() == [3.0, -3.0, 2.0, 2.0]  # half away from zero is accepted too
    far = torch.tensor([2.5 + 2**-13])  # outside the allowance: one code only
    assert torch.equal(*spec.decode_alternatives(far, torch.ones(1)))


def test_the_wire_cost_and_the_exactness_threshold():
    assert spec.wire_bytes_per_element(64) == 1 + 4 / 64
    assert spec.wire_bytes_per_element(8192) == 1 + 4 / 8192
    assert spec.travels_exactly(65_536) and not spec.travels_exactly(65_537)
    with pytest.raises(ValueError, match="group_size: 0 is invalid"):
        spec.wire_bytes_per_element(0)


def test_a_gather_over_one_rank_travels_exactly():
    assert spec.gather_travels_exactly(1) and not spec.gather_travels_exactly(2)
    for bad in (0, True, 1.0):
        with pytest.raises(ValueError, match="gather_ranks"):
            spec.gather_travels_exactly(bad)
