"""The journal's record encoding: COMMITs and EVICTs encoded from columns are the bytes of their
records."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gdskv.journal import (MAX_KEY_BYTES, Record, RecordKind, check_key, decode_all,
                           encode_all, encode_commits, encode_evictions, keys_fit)

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


@settings(max_examples=100, deadline=None)
@given(st.lists(st.tuples(KEYS, U64, U64), max_size=40))
def test_evictions_from_columns_are_their_records_bytes(pages):
    records = [Record(RecordKind.EVICT, seq, slot, 0, 0, key) for key, slot, seq in pages]
    got = encode_evictions([p[0] for p in pages], [p[1] for p in pages], [p[2] for p in pages])
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


@settings(max_examples=300, deadline=None)
@given(st.lists(st.one_of(KEYS, st.integers(),
                          st.sampled_from(["\ud800", "x" * (MAX_KEY_BYTES + 1),
                                           b"y" * (MAX_KEY_BYTES + 1)])),
                min_size=1, max_size=12))
def test_keys_fit_only_when_each_key_passes_check_key(keys):
    """``keys_fit`` (C loops over a call's keys) says yes only where ``check_key`` passes every
    key; a no sends the tier to the key-by-key check, which names the bad key."""
    def passes(k) -> bool:
        try:
            check_key(k)
        except (TypeError, ValueError):
            return False
        return True
    if keys_fit(keys):
        assert all(passes(k) for k in keys)


def test_keys_fit_takes_the_usual_keys():
    assert keys_fit(["ab" * 32] * 3) and keys_fit([b"\xff" * MAX_KEY_BYTES])
    assert keys_fit(["a" * MAX_KEY_BYTES])
    assert not keys_fit(["a" * (MAX_KEY_BYTES + 1)]) and not keys_fit(["é"])
    assert not keys_fit(["a", b"a"]) and not keys_fit([7]) and not keys_fit([])
