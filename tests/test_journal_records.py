"""The journal's record encoding: COMMITs encoded from columns are the bytes of their records."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gdskv.journal import (MAX_KEY_BYTES, Record, RecordKind, decode_all, encode_all,
                           encode_commits)

U64 = st.integers(min_value=0, max_value=2**64 - 1)
KEYS = st.one_of(st.text(min_size=1, max_size=80), st.binary(min_size=1, max_size=80),
                 st.sampled_from(["é" * 20000, "a" * MAX_KEY_BYTES, b"\0" * 300]))


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(KEYS, U64, U64, U64), max_size=40), st.integers(0, 255))
def test_commits_from_columns_are_their_records_bytes(pages, algorithm):
    keys = [k for k, *_ in pages]
    slots, sums, seqs = ([p[i] for p in pages] for i in (1, 2, 3))
    records = [Record(RecordKind.COMMIT, seq, slot, csum, algorithm, key)
               for key, slot, csum, seq in pages]
    got = encode_commits(keys, slots, sums, algorithm, seqs)
    assert got == encode_all(records)
    assert decode_all(got.data).records == records


@pytest.mark.parametrize("key, error", [("x" * (MAX_KEY_BYTES + 1), ValueError),
                                        ("é" * (MAX_KEY_BYTES // 2 + 1), ValueError),
                                        ("\ud800", UnicodeEncodeError), (7, TypeError)])
def test_commits_from_columns_refuse_what_records_refuse(key, error):
    with pytest.raises(error):
        encode_commits(["ok", key], [0, 1], [0, 0], 1, [1, 2])
    with pytest.raises(error):
        encode_all([Record(RecordKind.COMMIT, 1, 0, 0, 1, key)])
