"""The size rule is ``check_size``'s: the HTTP ``size`` field is parsed, checked by it, and its
refusal reworded for ``size`` (which bound failed is asked of ``check_size`` too)."""

from __future__ import annotations

import dataclasses

import pytest
from sglang.multimodal_gen.configs.sampling_params import RequestLimits, RequestSpec
from sglang.multimodal_gen.entrypoints.protocol import parse_size
from sglang.multimodal_gen.errors import InvalidRequestError


def _spec(factor=16, top=1024) -> RequestSpec:
    spec = dataclasses.replace(RequestSpec.generic(), spatial_factor=factor)
    return spec.with_limits(RequestLimits(max_image_size=top))


@pytest.mark.parametrize(
    "size,reason",
    [
        ("33x32", "width and height must be multiples of 16 for this model"),
        ("32x40", "width and height must be multiples of 16 for this model"),
        ("2048x32", "larger than the server's maximum 1024 per side (--max-image-size)"),
        ("2050x33", "larger than the server's maximum 1024 per side (--max-image-size)"),
    ],
)
def test_a_refused_size_names_the_bound_it_fails(size, reason):
    with pytest.raises(InvalidRequestError) as e:
        parse_size(size, _spec())
    assert e.value.param == "size"
    assert str(e.value) == (
        f"invalid size {size!r}: {reason}; expected 'WxH' with W and H multiples of 16 in "
        "[16, 1024], e.g. '1024x1024'"
    )


def test_accepted_sizes():
    assert parse_size("48x1024", _spec()) == (48, 1024)
    assert parse_size("7x9", _spec(factor=1, top=None)) == (7, 9)
