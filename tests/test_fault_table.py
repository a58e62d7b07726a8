"""Issue 15's fault table, re-measured (bench/experiments/fault_table.py): one fault per trial,
6 trials per class. Wrong bytes are never served; a damaged slab loses only the damaged page;
journal damage (a flipped bit, a cut, deletion) loses nothing once the slot trailers are
scanned; a damaged manifest is restored from its copy."""

from __future__ import annotations

import pytest

import fault_table


@pytest.fixture(scope="module")
def table(tmp_path_factory):
    return fault_table.run(trials=6, seed=1, parent=str(tmp_path_factory.mktemp("faults")))


@pytest.mark.parametrize("fault", fault_table.FAULTS)
def test_no_wrong_bytes(table, fault):
    assert table[fault]["wrong"] == 0, table[fault]


@pytest.mark.parametrize("fault", ["slab-bit", "slab-zero"])
def test_slab_damage_loses_only_that_page(table, fault):
    assert table[fault]["per_trial"] == [fault_table.PAGES - 1] * 6, table[fault]


@pytest.mark.parametrize("fault", ["journal-bit", "journal-cut", "journal-gone", "manifest-bit"])
def test_metadata_damage_loses_nothing(table, fault):
    row = table[fault]
    assert row["per_trial"] == [fault_table.PAGES] * 6 and not row["refused"], row
