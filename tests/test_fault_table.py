"""Issue 15's fault table, re-measured (bench/experiments/fault_table.py): one fault per trial,
6 trials per class. Wrong bytes are never served; a flipped journal bit loses at most the one
page of the record it hit."""

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


def test_journal_bit_loses_at_most_one_record(table):
    row = table["journal-bit"]
    assert min(row["per_trial"]) >= fault_table.PAGES - 1, row
