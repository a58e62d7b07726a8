"""Model presets, the recompute break-even, and sweep plotting (synthetic results)."""

from __future__ import annotations

import json
import os

import pytest

from gdskv.bench.presets import PRESETS, break_even, get_preset
from gdskv.bench.sweep import plot, series, write_point


@pytest.mark.parametrize("name, layers, heads, dim, mla, bytes_per_token", [
    ("llama3-8b", 32, 8, 128, False, 2 * 32 * 8 * 128 * 2),      # 128 KiB / token
    ("llama3-70b", 80, 8, 128, False, 2 * 80 * 8 * 128 * 2),
    ("qwen2.5-7b", 28, 4, 128, False, 2 * 28 * 4 * 128 * 2),
    ("deepseek-v3", 61, 1, 576, True, 61 * 576 * 2),             # one latent row per layer
])
def test_preset_geometry(name, layers, heads, dim, mla, bytes_per_token):
    p = get_preset(name)
    lay = p.layout(16)
    assert (lay.num_layers, lay.kv_heads, lay.head_dim, lay.mla) == (layers, heads, dim, mla)
    assert lay.page_bytes == 16 * bytes_per_token
    assert p.flops_per_token == 2 * p.active_params


def test_unknown_preset():
    with pytest.raises(ValueError, match="gpt-x"):
        get_preset("gpt-x")
    assert set(PRESETS) >= {"llama3-8b", "llama3-70b", "qwen2.5-7b", "deepseek-v3"}


def test_break_even_llama3_8b():
    p = get_preset("llama3-8b")
    lay = p.layout(16)
    be = break_even(lay, p.flops_per_token, prefill_tflops=400, read_bytes_per_s=2e9)
    # recompute: 2 * 8.03e9 FLOPs / 400e12 FLOP/s = 40.15 us per token
    assert be.recompute_s_per_token == pytest.approx(2 * 8.03e9 / 400e12)
    # restore: 131072 B / 2 GB/s = 65.5 us per token
    assert be.restore_s_per_token == pytest.approx(131072 / 2e9)
    # break-even: 131072 B in 40.15 us = 3.26 GB/s
    assert be.break_even_bytes_per_s == pytest.approx(131072 / (2 * 8.03e9 / 400e12))
    assert be.speedup == pytest.approx(be.recompute_s_per_token / be.restore_s_per_token)
    assert be.speedup < 1  # 2 GB/s is below break-even: recompute wins here
    d = be.to_dict()
    assert d["restore_us_per_token"] == pytest.approx(65.536)
    with pytest.raises(ValueError, match="prefill_tflops"):
        break_even(lay, p.flops_per_token, 0)


def _doc(engine: str, backend: str, wbw: float, rbw: float) -> dict:
    return {"jobs": [{"gdskv": {"engine": engine, "backend": backend},
                      "write": {"bw_bytes": int(wbw)}, "read": {"bw_bytes": int(rbw)}}]}


def test_sweep_series_and_png(tmp_path):
    points = []
    for bs, scale in ((64 << 10, 1.0), (1 << 20, 2.0), (16 << 20, 3.0)):
        doc = {"jobs": _doc("gdskv", "posix", 1e9 * scale, 0.8e9 * scale)["jobs"]
               + _doc("raw", "posix", 1.1e9 * scale, 0.9e9 * scale)["jobs"]
               + _doc("hicachefile", "sglang HiCacheFile", 0.4e9, 0.3e9)["jobs"]}
        path = write_point(str(tmp_path), "bs", str(bs), doc)
        with open(path, encoding="utf-8") as f:
            assert json.load(f) == doc
        points.append((float(bs), doc))
    lines = series(points)
    assert set(lines) == {"gdskv/posix write", "gdskv/posix read", "raw/posix write",
                          "raw/posix read", "hicachefile write", "hicachefile read"}
    assert lines["gdskv/posix write"] == [(65536.0, 1.0), (1048576.0, 2.0), (16777216.0, 3.0)]
    png = plot(lines, "bs", str(tmp_path / "sweep-bs.png"))
    with open(png, "rb") as f:
        head = f.read(8)
    assert head == b"\x89PNG\r\n\x1a\n" and os.path.getsize(png) > 10_000
