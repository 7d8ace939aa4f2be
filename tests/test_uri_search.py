"""The dialect check's search for a ``file://`` value agrees with a plain substring search.

It looks for ``:`` with ``memchr`` in windows of the params (so a long
``fs/writeFile`` is searched fast and never copied whole): any params,
including a needle across a window's edge, give what ``in`` gives.
"""

from __future__ import annotations

import msgspec
from hypothesis import given
from hypothesis import strategies as st

from execserver import dispatcher

NEEDLE = b'"file://'


@given(
    st.lists(st.sampled_from([b'"', b"file", b":", b"//", b"/", b"A", b"f", b"ile:"]), max_size=40)
)
def test_agrees_with_a_substring_search(pieces: list[bytes]) -> None:
    data = b"".join(pieces)
    assert dispatcher._has_uri_value(msgspec.Raw(data)) == (NEEDLE in data)


@given(st.integers(0, 3 * dispatcher._URI_WINDOW), st.booleans())
def test_a_needle_anywhere_in_long_params_is_found(offset: int, present: bool) -> None:
    filler = b"A" * offset
    value = b'"file:///x"' if present else b'"/x"'
    data = b'{"dataBase64":"' + filler + b'","path":' + value + b"}"
    assert dispatcher._has_uri_value(msgspec.Raw(data)) is present
