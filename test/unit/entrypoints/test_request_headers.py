"""A header that decides who a request acts for, where it comes from or how its body is read is
refused when sent twice (``entrypoints/request_headers.py``)."""

from __future__ import annotations

import pytest
from sglang.multimodal_gen.entrypoints.request_headers import (
    SINGLE_HEADERS,
    duplicated_header,
    single_headers,
)


@pytest.mark.parametrize("name", sorted(SINGLE_HEADERS))
def test_each_security_relevant_header_only_once(name):
    headers = [(b"accept", b"*/*"), (name, b"one"), (b"x", b"y"), (name, b"two")]
    assert duplicated_header(headers) == SINGLE_HEADERS[name]
    assert duplicated_header([(name, b"one")]) is None


def test_names_are_compared_without_case_and_other_headers_may_repeat():
    assert duplicated_header([(b"Authorization", b"a"), (b"authorization", b"b")])
    assert duplicated_header([(b"accept", b"a"), (b"accept", b"b")]) is None
    assert duplicated_header([(b"x-request-id", b"a"), (b"x-request-id", b"b")]) is None
    assert single_headers([(b"accept", b"a"), (b"Accept", b"b")]) == {b"accept": b"a"}
