"""The transformers prefix-cache example (examples/transformers_prefix_cache.py) and the TTFT
bench built on it (bench/experiments/ttft.py), with a 2-layer random Llama on the CPU: a
restored prefix must give the very KV the prefill made and, prefilling the same suffix, the very
logits the prefill's own cache gives. One byte off anywhere fails these tests."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys

import pytest
import torch

pytest.importorskip("transformers", reason="transformers is not installed (the test extra)")

from gdskv import TierConfig  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
EXAMPLE = os.path.join(ROOT, "examples", "transformers_prefix_cache.py")
PAGE = 16


def load_example():
    spec = importlib.util.spec_from_file_location("transformers_prefix_cache", EXAMPLE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


ex = load_example()


@pytest.fixture(scope="module")
def model():
    return ex.tiny_llama("cpu", torch.float32)


def prompt(n: int, seed: int) -> torch.Tensor:
    return torch.randint(0, 512, (1, n), generator=torch.Generator().manual_seed(seed))


def same_kv(restored, original, tokens: int) -> bool:
    return all(torch.equal(a.keys[..., :tokens, :], b.keys[..., :tokens, :]) and
               torch.equal(a.values[..., :tokens, :], b.values[..., :tokens, :])
               for a, b in zip(restored.layers, original.layers))


def cut(cache, tokens: int):
    """The prefill's own cache, its first ``tokens`` tokens (views: nothing copied)."""
    return ex.cache_from([layer.keys[..., :tokens, :] for layer in cache.layers],
                         [layer.values[..., :tokens, :] for layer in cache.layers])


@pytest.fixture
def prefixes(model, tmp_path):
    config = TierConfig(directories=(str(tmp_path),), backend="posix", capacity="64MiB",
                        io_chunk_size=1 << 20, staging_size=4 << 20)
    with ex.PrefixCache(model.config, config, page_size=PAGE, dtype=torch.float32,
                        device="cpu", model_name="tiny-test") as pc:
        yield pc


@torch.no_grad()
def test_restored_prefix_gives_the_prefills_kv_and_logits(model, prefixes):
    first = prompt(5 * PAGE + 3, seed=1)
    _, cache = ex.forward(model, first)
    keys = prefixes.page_keys(first)
    assert prefixes.spill(keys, cache) == 5

    # a second request: the first 4 pages shared, then its own tokens
    second = torch.cat([first[:, :4 * PAGE + 5], prompt(30, seed=2)], 1)
    wanted = prefixes.page_keys(second)[:(second.shape[1] - 1) // PAGE]
    assert wanted[:4] == keys[:4] and wanted[4] != keys[4]
    restored, tokens = prefixes.restore(wanted)
    assert tokens == 4 * PAGE
    assert all(layer.keys.shape == (1, 2, tokens, 16) for layer in restored.layers)
    assert same_kv(restored, cache, tokens)

    logits, grown = ex.forward(model, second[:, tokens:], restored)
    reference, _ = ex.forward(model, second[:, tokens:], cut(cache, tokens))
    assert torch.equal(logits, reference)
    assert grown.get_seq_length() == second.shape[1]

    # what these checks catch: one bit of one restored element (a mantissa bit that moves
    # the value by a quarter) changes the suffix's logits, and the KV comparison sees it
    restored, _ = prefixes.restore(wanted)
    one = restored.layers[1].values
    one.view(torch.int32)[0, 1, tokens - 1, 3] ^= 1 << 21
    assert not same_kv(restored, cache, tokens)
    off, _ = ex.forward(model, second[:, tokens:], restored)
    assert not torch.equal(off, reference)


@torch.no_grad()
def test_nothing_stored_and_a_damaged_page_end_the_prefix(model, prefixes, tmp_path):
    ids = prompt(3 * PAGE + 1, seed=3)
    keys = prefixes.page_keys(ids)
    assert prefixes.restore(keys) == (None, 0)

    _, cache = ex.forward(model, ids)
    assert prefixes.spill(keys, cache) == 3
    # page 1 on disk: its first rows are layer 0's K of head 0 (the layout's row order)
    needle = cache.layers[0].keys[0, 0, PAGE:2 * PAGE].contiguous().numpy().tobytes()
    hits = []
    for name in os.listdir(tmp_path):
        path = tmp_path / name
        if name.startswith("slab-"):
            data = path.read_bytes()
            at = data.find(needle)
            if at >= 0:
                hits.append(name)
                with open(path, "r+b") as f:
                    f.seek(at + 100)
                    f.write(bytes([data[at + 100] ^ 0x40]))
    assert len(hits) == 1
    restored, tokens = prefixes.restore(keys)  # page 1 fails its checksum: a miss
    assert tokens == PAGE
    assert same_kv(restored, cache, PAGE)


def test_cache_layout_refuses_pages_over_gdskvs_rows(model):
    with pytest.raises(ValueError, match=r"page_size 256 x 2 KV heads .* page_size <= 128"):
        ex.cache_layout(model.config, 256, torch.float32)


def test_example_runs(tmp_path):
    env = {k: v for k, v in os.environ.items() if not k.startswith("GDSKV_")}
    env["PYTHONPATH"] = ROOT + os.pathsep + env.get("PYTHONPATH", "")
    out = subprocess.run([sys.executable, EXAMPLE, "--dir", str(tmp_path)], capture_output=True,
                         text=True, env=env, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "request 2: restored 192 tokens, prefilled 29" in out.stdout
    assert "restored KV bit-exact: True; logits bit-exact: True" in out.stdout


def test_ttft_bench_tiny_on_cpu(tmp_path):
    """The bench's every path on the CPU (posix backend): each restore checked bit-exact."""
    result = tmp_path / "ttft.json"
    out = subprocess.run(
        [sys.executable, os.path.join(ROOT, "bench", "experiments", "ttft.py"), "--device",
         "cpu", "--tiny", "--tokens", "64", "--dirs", str(tmp_path / "store"), "--repeat", "1",
         "--decode-steps", "2", "--json", str(result)],
        capture_output=True, text=True, timeout=600, cwd="/")
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    r = json.loads(result.read_text())
    assert r["model"]["layers"] == 2 and r["errors"] == [] and r["not_bit_exact"] == []
    (run,) = r["runs"]
    assert run["backend"]["backend"] == "posix"
    assert sorted(run["paths"]) == ["hit50", "hit90", "restore", "restore_pool_copy"]
    for name, path in run["paths"].items():
        assert path["bit_exact_kv"] and path["bit_exact_logits"], name
        assert path["restored_tokens"] + path["prefilled_tokens"] == 64
    assert run["paths"]["restore"]["restored_tokens"] == 48  # whole pages, a token left
    assert run["decode"]["spills_finished"] >= 1
    assert out.stdout.rstrip().splitlines()[-1].split()[-1] == "ok"  # the table comes last


def test_ttft_bench_table_and_plot_from_results(tmp_path, capsys):
    """``--from-json``: the table (and plot) of results written before, two calls' as one."""
    ttft = pytest.importorskip("ttft")  # bench/experiments, on pytest's pythonpath
    run = {"tokens": 4096, "dir": "/mnt/x", "medium": {"fs_type": "ext4"},
           "raw_kvikio": {"gbps": 2.0}, "spill": {"ms": 300.0}, "break_even_gbps": 1.5,
           "decode": {"slowdown": 1.25},
           "paths": {"restore": {"ttft_ms": 200.0, "speedup": 2.5, "restore_gbps": 1.8,
                                 "restore_vs_raw": 0.9, "bit_exact_kv": True,
                                 "bit_exact_logits": True},
                     "hit50": {"oom": "OutOfMemoryError()"}}}
    first = {"device": {"name": "GPU"}, "model": {"name": "m"},
             "prefill": {"4096": {"ttft_ms": 500.0}}, "runs": [run]}
    second = {**first, "prefill": {"8192": {"oom": "OutOfMemoryError()"}}, "runs": []}
    paths = []
    for i, r in enumerate((first, second)):
        paths.append(tmp_path / f"{i}.json")
        paths[-1].write_text(json.dumps(r))
    png = tmp_path / "ttft.png"
    assert ttft.main(["--from-json", ",".join(map(str, paths)), "--plot", str(png)]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert png.stat().st_size > 1000 if "plot written" in lines[0] else "skipped" in lines[0]
    assert lines[-5].split() == ["N", "medium", "path", "TTFT", "ms", "speedup", "GB/s", "raw",
                                 "r/raw", "need", "spill", "ms", "decode", "exact"]
    assert lines[-4].split()[:4] == ["4096", "-", "prefill", "500.0"]
    assert lines[-3].split() == ["8192", "-", "prefill", "oom:", "OutOfMemoryError()"]
    assert lines[-2].split() == ["4096", "ext4:x", "restore", "200.0", "2.50x", "1.80", "2.00",
                                 "0.90", "1.50", "300.0", "1.25x", "ok"]
    assert lines[-1].split() == ["4096", "ext4:x", "hit50", "OutOfMemoryError()"]
