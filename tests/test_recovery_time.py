"""Restart recovery speed (loose bound for CI; bench/experiments/recovery_bench.py measures 100k
pages)."""

from __future__ import annotations

import os

import pytest

import recovery_bench


@pytest.mark.parametrize("pages", [20_000])
def test_recovery_is_fast(tmp_path, pages):
    os.chmod(tmp_path, 0o700)
    recovery_bench.build(str(tmp_path), pages, puts=False)
    seconds = min(recovery_bench.measure(str(tmp_path), pages) for _ in range(2))
    print(f"recovered {pages} pages in {seconds:.3f} s")
    assert seconds < 2.0, f"recovering {pages} pages took {seconds:.2f} s (target: 100k in 2 s)"


@pytest.mark.slow
def test_recovery_100k_pages(tmp_path):
    os.chmod(tmp_path, 0o700)
    recovery_bench.build(str(tmp_path), 100_000, puts=False)
    seconds = min(recovery_bench.measure(str(tmp_path), 100_000) for _ in range(3))
    print(f"recovered 100000 pages in {seconds:.3f} s")
    assert seconds < 2.0
