"""The transformers prefix-cache example (examples/transformers_prefix_cache.py) and the TTFT
bench built on it (bench/experiments/ttft.py), with a 2-layer random Llama on the CPU: a
restored prefix must give the very KV the prefill made and, prefilling the same suffix, the very
logits the prefill's own cache gives. One byte off anywhere fails these tests. The CUDA graph of
the suffix's forward is tested on a GPU only (marked ``gpu``)."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys

import pytest
import torch

pytest.importorskip("transformers", reason="transformers is not installed (the test extra)")

from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402

from gdskv import TierConfig  # noqa: E402
from gdskv.memory import cuda_available  # noqa: E402
from ttft import (SUFFIX_ATTENTIONS, SuffixForward, _flash_attention,  # noqa: E402
                  _grouped_attention)  # (bench/experiments: pytest's pythonpath)

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


def static_copy(model, cache, tokens: int, capacity: int):
    """A new StaticCache holding the prefill's first ``tokens`` tokens (copied in)."""
    static = ex.static_cache(model, capacity)
    for mine, theirs in zip(static.layers, cache.layers):
        mine.keys[..., :tokens, :].copy_(theirs.keys[..., :tokens, :])
        mine.values[..., :tokens, :].copy_(theirs.values[..., :tokens, :])
        mine.cumulative_length.fill_(tokens)
    return static


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


@torch.no_grad()
def test_restore_into_a_static_cache_gives_the_prefills_kv_and_logits(model, prefixes):
    first = prompt(5 * PAGE + 3, seed=4)
    _, cache = ex.forward(model, first)
    keys = prefixes.page_keys(first)
    static = ex.static_cache(model, 8 * PAGE)
    assert prefixes.restore_static(keys, static) == 0  # nothing stored yet
    assert int(static.get_seq_length()) == 0
    assert prefixes.spill(keys, cache) == 5

    second = torch.cat([first[:, :4 * PAGE + 5], prompt(30, seed=5)], 1)
    wanted = prefixes.page_keys(second)[:(second.shape[1] - 1) // PAGE]
    tokens = prefixes.restore_static(wanted, static)
    assert tokens == 4 * PAGE and int(static.get_seq_length()) == tokens
    assert same_kv(static, cache, tokens)

    logits, _ = ex.forward(model, second[:, tokens:], static)  # transformers' own forward
    reference, _ = ex.forward(model, second[:, tokens:],
                              static_copy(model, cache, tokens, 8 * PAGE))
    assert torch.equal(logits, reference)

    # the bench's capturable forward (explicit mask, positions from tensors) on the restored
    # cache against the same on the prefill's own KV
    suffix = second[:, tokens:]
    restored = SuffixForward(model, static, suffix.shape[1], ex.cache_argument(type(model)))
    own = SuffixForward(model, static_copy(model, cache, tokens, 8 * PAGE), suffix.shape[1],
                        ex.cache_argument(type(model)))
    assert prefixes.restore_static(wanted, static) == tokens  # the forward above wrote on
    for f in (restored, own):
        f.set(suffix, tokens)
    expected = own.eager().clone()
    assert torch.equal(restored.eager(), expected)

    # one bit of one restored element: the KV comparison and the logits both see it
    assert prefixes.restore_static(wanted, static) == tokens
    static.layers[1].values.view(torch.int32)[0, 1, tokens - 1, 3] ^= 1 << 21
    assert not same_kv(static, cache, tokens)
    restored.set(suffix, tokens)
    assert not torch.equal(restored.eager(), expected)

    # a cache too short for the stored prefix takes the pages that fit
    short = ex.static_cache(model, 3 * PAGE + 8)
    assert prefixes.restore_static(wanted, short) == 3 * PAGE
    assert same_kv(short, cache, 3 * PAGE)


def test_restore_static_refuses_a_cache_without_tensors_or_with_sliding_layers(model,
                                                                            prefixes):
    import transformers
    lazy = transformers.StaticCache(config=model.config, max_cache_len=64)
    with pytest.raises(ValueError, match="no tensors yet .*static_cache"):
        prefixes.restore_static(["k"], lazy)
    sliding = transformers.MistralConfig(**{**model.config.to_dict(), "sliding_window": 32})
    ring = transformers.StaticCache(config=sliding, max_cache_len=64)
    with pytest.raises(ValueError, match="sliding-window layers"):
        prefixes.restore_static(["k"], ring)


class HostReads(TorchDispatchMode):
    """Counts the ops that read a tensor's value back to the host (``.item()``, ``bool()``,
    ``nonzero``): none may happen while a CUDA graph is captured."""

    READS = {torch.ops.aten._local_scalar_dense.default, torch.ops.aten.nonzero.default}

    def __init__(self) -> None:
        super().__init__()
        self.seen: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func in self.READS:
            self.seen.append(str(func))
        return func(*args, **(kwargs or {}))


@torch.no_grad()
def test_the_suffix_forward_reads_nothing_back_and_follows_its_input_tensors(model):
    ids = prompt(3 * PAGE + 5, seed=6)
    _, cache = ex.forward(model, ids)
    static = static_copy(model, cache, 3 * PAGE, 4 * PAGE)
    forward = SuffixForward(model, static, 5, ex.cache_argument(type(model)))
    forward.set(ids[:, 3 * PAGE:], 3 * PAGE)
    with HostReads() as reads:
        first = forward.eager().clone()
    assert reads.seen == []
    with HostReads() as reads:  # what the mode catches: a tensor's value used by Python
        bool(static.get_seq_length() == 0)
    assert reads.seen == ["aten._local_scalar_dense.default"]

    # the forward's inputs are the tensors set() fills: other ids, another start, other logits;
    # the same inputs again, the same logits
    forward.set(prompt(5, seed=7), 3 * PAGE)
    assert not torch.equal(forward.eager(), first)
    forward.set(ids[:, 3 * PAGE:], 3 * PAGE)
    assert torch.equal(forward.eager(), first)
    # where the suffix's KV goes comes from start too, not from what the cache counted
    for layer in static.layers:
        layer.cumulative_length.fill_(0)
    assert torch.equal(forward.eager(), first)
    assert int(static.get_seq_length()) == 3 * PAGE + 5
    with pytest.raises(ValueError, match=r"ids of shape \(1, 4\)"):
        forward.set(ids[:, :4], 0)
    with pytest.raises(ValueError, match="start 60 leaves no room for 5 tokens in 64"):
        forward.set(ids[:, :5], 60)
    with pytest.raises(RuntimeError, match="capture"):
        forward.replay()


@pytest.mark.gpu
@pytest.mark.skipif(not cuda_available(), reason="needs a CUDA device (none here)")
@torch.no_grad()
def test_the_suffix_forward_replayed_as_a_cuda_graph_gives_the_eager_logits():
    model = ex.tiny_llama("cuda", torch.bfloat16)
    ids = prompt(6 * PAGE, seed=8).cuda()
    _, cache = ex.forward(model, ids)
    static = static_copy(model, cache, 5 * PAGE, 6 * PAGE)
    forward = SuffixForward(model, static, PAGE, ex.cache_argument(type(model)))
    forward.set(ids[:, 5 * PAGE:], 5 * PAGE)
    eager = forward.eager().clone()
    forward.capture()
    assert torch.equal(forward.replay().clone(), eager)

    # other inputs through the same graph: the replay follows the tensors set() fills
    other, start = prompt(PAGE, seed=9).cuda(), 2 * PAGE
    forward.set(other, start)
    replayed = forward.replay().clone()
    forward.set(other, start)
    assert torch.equal(replayed, forward.eager())
    assert not torch.equal(replayed, eager)


@pytest.mark.parametrize("kernel", [_grouped_attention, _flash_attention])
@pytest.mark.parametrize("lq,lk", [(1, 9), (5, 5), (7, 40)])
def test_suffix_attention_kernels_attend_causally_from_the_lower_right(kernel, lq, lk):
    """Each query ``i`` of the last ``lq`` positions attends to keys ``0 .. lk - lq + i``, each
    query head to its own KV head (4 query heads share one): against the plain definition."""
    g = torch.Generator().manual_seed(lq * 100 + lk)
    q = torch.randn(1, 8, lq, 16, generator=g, dtype=torch.float64)
    k, v = (torch.randn(1, 2, lk, 16, generator=g, dtype=torch.float64) for _ in range(2))
    kk, vv = k.repeat_interleave(4, dim=1), v.repeat_interleave(4, dim=1)
    scores = q @ kk.transpose(2, 3) * 0.25
    allowed = torch.arange(lk)[None, :] <= (lk - lq + torch.arange(lq))[:, None]
    expected = torch.softmax(scores.masked_fill(~allowed, float("-inf")), -1) @ vv
    got = kernel(q, k, v, 0.25)
    assert got.shape == expected.shape
    torch.testing.assert_close(got, expected)
    # the last query sees every key; the first one key fewer per query after it
    assert not torch.allclose(kernel(q, k, v * 2, 0.25), got)


@pytest.mark.parametrize("attention", [a for a in SUFFIX_ATTENTIONS if a != "mask"])
@torch.no_grad()
def test_suffix_forward_with_its_own_attention_on_a_restored_cache(model, prefixes, attention):
    """``grouped``/``flash``: the suffix is the cache's last tokens; on the restored cache the
    logits equal the same forward on the prefill's own KV bit for bit, and they agree with
    transformers' masked path to rounding."""
    ids = prompt(4 * PAGE + 6, seed=11)
    _, cache = ex.forward(model, ids)
    keys = prefixes.page_keys(ids)
    assert prefixes.spill(keys, cache) == 4
    n, t = ids.shape[1], 4 * PAGE
    static = ex.static_cache(model, n)
    assert prefixes.restore_static(keys, static) == t
    arg = ex.cache_argument(type(model))
    restored = SuffixForward(model, static, n - t, arg, attention)
    own = SuffixForward(model, static_copy(model, cache, t, n), n - t, arg, attention)
    masked = SuffixForward(model, static_copy(model, cache, t, n), n - t, arg, "mask")
    for f in (restored, own, masked):
        f.set(ids[:, t:], t)
    expected = own.eager().clone()
    assert torch.equal(restored.eager(), expected)
    torch.testing.assert_close(expected, masked.eager(), rtol=0, atol=1e-4)
    assert model.config._attn_implementation == "sdpa"  # the forward's choice is its own
    with pytest.raises(ValueError, match=f"{attention} attention takes the suffix as the "
                                         f"cache's last {n - t} of {n} positions"):
        restored.set(ids[:, t:], t - 1)
    with pytest.raises(ValueError, match="attention 'paged' is not one of"):
        SuffixForward(model, static, n - t, arg, "paged")


def test_restore_static_passes_the_tier_the_same_pool_every_call(model, prefixes,
                                                                 monkeypatch):
    """The StaticCache's view is made once: the tier's pool cache finds it on later calls (a
    new view each call would be checked again: host time on every restore)."""
    import gdskv.pool
    ids = prompt(6 * PAGE + 1, seed=12)
    _, cache = ex.forward(model, ids)
    keys = prefixes.page_keys(ids)
    assert prefixes.spill(keys, cache) == 6
    static = ex.static_cache(model, 8 * PAGE)
    assert prefixes.restore_static(keys, static) == 6 * PAGE
    made, init = [], gdskv.pool.KVPool.__init__

    def counted(self, *args, **kwargs):
        made.append(1)
        init(self, *args, **kwargs)
    monkeypatch.setattr(gdskv.pool.KVPool, "__init__", counted)
    assert prefixes.restore_static(keys[:3], static) == 3 * PAGE
    assert prefixes.restore_static(keys, static) == 6 * PAGE
    assert made == [] and same_kv(static, cache, 6 * PAGE)
    other = ex.static_cache(model, 8 * PAGE)  # another cache: its own view, made once
    assert prefixes.restore_static(keys, other) == 6 * PAGE
    assert prefixes.restore_static(keys, other) == 6 * PAGE
    assert made == [1] and same_kv(other, cache, 6 * PAGE)


@torch.no_grad()
def test_a_latent_attention_models_cache_goes_in_column_blocks(tmp_path):
    """DeepSeek-V2 (MLA): transformers caches a 32-wide latent and an 8-wide rotary key a
    layer. They go to gdskv as 8-wide column blocks, a tier "layer" each; restored into a
    DynamicCache and into a StaticCache they are the prefill's bytes, and the suffix's logits
    are the ones on the prefill's own cache; one flipped bit shows."""
    model = ex.tiny_deepseek("cpu", torch.float32)
    layout = ex.cache_layout(model.config, PAGE, torch.float32)
    assert layout.mla and layout.head_dim == 8 and layout.num_layers == 2 * (4 + 1)
    assert layout.page_bytes == PAGE * ex.kv_bytes_per_token(model.config, torch.float32)
    config = TierConfig(directories=(str(tmp_path),), backend="posix", capacity="64MiB",
                        io_chunk_size=1 << 20, staging_size=4 << 20)
    ids = prompt(5 * PAGE + 3, seed=21)
    _, cache = ex.forward(model, ids)
    assert cache.layers[0].keys.shape[-1] == 32 and cache.layers[0].values.shape[-1] == 8
    with ex.PrefixCache(model.config, config, page_size=PAGE, dtype=torch.float32,
                        device="cpu", model_name="tiny-mla") as pc:
        keys = pc.page_keys(ids)
        assert pc.spill(keys, cache) == 5
        restored, tokens = pc.restore(keys)
        assert tokens == 5 * PAGE and same_kv(restored, cache, tokens)
        suffix = ids[:, tokens:]
        expected = ex.forward(model, suffix, cut(cache, tokens))[0]
        assert torch.equal(ex.forward(model, suffix, restored)[0], expected)

        static = ex.static_cache(model, ids.shape[1])
        assert pc.restore_static(keys, static) == tokens and same_kv(static, cache, tokens)
        forward = SuffixForward(model, static, suffix.shape[1], ex.cache_argument(type(model)),
                                "flash")
        own = SuffixForward(model, static_copy(model, cache, tokens, ids.shape[1]),
                            suffix.shape[1], ex.cache_argument(type(model)), "flash")
        for f in (forward, own):
            f.set(suffix, tokens)
        reference = own.eager().clone()
        assert torch.equal(forward.eager(), reference)
        static.layers[1].values.view(torch.int32)[0, 0, tokens - 2, 5] ^= 1 << 20  # rotary key
        assert not same_kv(static, cache, tokens)
        forward.set(suffix, tokens)
        assert not torch.equal(forward.eager(), reference)


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
    assert list(run["paths"]) == ["restore", "restore_graph", "hit90", "hit50",
                                  "restore_pool_copy"]
    for name, path in run["paths"].items():
        assert path["bit_exact_kv"] and path["bit_exact_logits"], name
        assert path["restored_tokens"] + path["prefilled_tokens"] == 64
    assert run["paths"]["restore"]["restored_tokens"] == 48  # whole pages, a token left
    for name in ("restore", "restore_graph"):  # gdskv's read is part of the restore
        assert 0 < run["paths"][name]["restore_io_ms"] <= run["paths"][name]["restore_ms"]
    # no graph on the CPU: the StaticCache restore and its suffix run eagerly, checked, and
    # the path reported skipped (no TTFT of its own)
    graph = run["paths"]["restore_graph"]
    assert graph["skipped"].startswith("no CUDA device") and "ttft_ms" not in graph
    assert graph["restored_tokens"] == 48 and graph["max_cache_len"] == 64
    # the TTFT's attention is the first of --suffix-attention; each one's suffix on the
    # restored cache equals its own run on the prefill's KV
    assert graph["attention"] == "flash"
    assert list(graph["suffix_attention"]) == ["flash", "grouped", "mask"]
    for kind, a in graph["suffix_attention"].items():
        assert a["bit_exact_logits"] and a["suffix_ms"] > 0, kind
        assert a["max_abs_logit_diff_vs_mask"] < 1e-4, kind  # fp32: other kernels, same maths
    assert run["decode"]["spills_finished"] >= 1
    lines = out.stdout.rstrip().splitlines()
    assert lines[-2].split()[-1] == "ok"  # the table, then the suffix by attention
    assert lines[-5].split()[2:6] == ["restore_graph", "exact", "ok,", "skipped:"]
    assert lines[-1].startswith("64 ") and "suffix by attention: flash" in lines[-1]
    assert lines[-1].count("(exact)") == 3


def test_ttft_bench_runs_the_paths_named(tmp_path):
    """``--paths``: only the restore paths named (the prefill always), no decode."""
    bench = os.path.join(ROOT, "bench", "experiments", "ttft.py")
    result = tmp_path / "ttft.json"
    base = [sys.executable, bench, "--device", "cpu", "--tiny", "--tokens", "40", "--dirs",
            str(tmp_path / "store"), "--repeat", "1", "--no-decode", "--json", str(result)]
    out = subprocess.run(base + ["--paths", "prefill,restore_graph"], capture_output=True,
                         text=True, timeout=600, cwd="/")
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    r = json.loads(result.read_text())
    assert r["paths"] == ["prefill", "restore_graph"] and r["errors"] == []
    (run,) = r["runs"]
    assert list(run["paths"]) == ["restore_graph"] and "decode" not in run
    assert run["paths"]["restore_graph"]["restored_tokens"] == 32
    assert "ttft_ms" in r["prefill"]["40"]
    bad = subprocess.run(base + ["--paths", "restore,graph"], capture_output=True, text=True,
                         timeout=300, cwd="/")
    assert bad.returncode == 2 and "--paths: graph: name some of prefill,restore," in bad.stderr


def test_ttft_bench_table_and_plot_from_results(tmp_path, capsys):
    """``--from-json``: the table (and plot) of results written before, two calls' as one."""
    ttft = pytest.importorskip("ttft")  # bench/experiments, on pytest's pythonpath
    run = {"tokens": 4096, "dir": "/mnt/x", "medium": {"fs_type": "ext4"},
           "raw_kvikio": {"gbps": 2.0}, "spill": {"ms": 300.0}, "break_even_gbps": 1.5,
           "decode": {"slowdown": 1.25, "graph": {"slowdown": 1.5}},
           "paths": {"restore": {"ttft_ms": 200.0, "suffix_ms": 40.0, "speedup": 2.5,
                                 "restore_gbps": 1.8,
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
    assert lines[-5].split() == ["N", "medium", "path", "TTFT", "ms", "io", "ms", "sfx", "ms",
                                 "speedup", "GB/s", "raw", "r/raw", "need", "spill", "ms",
                                 "decode", "dec", "graph", "exact"]
    assert lines[-4].split()[:7] == ["4096", "-", "prefill", "500.0", "-", "-", "1.00x"]
    assert lines[-3].split() == ["8192", "-", "prefill", "oom:", "OutOfMemoryError()"]
    assert lines[-2].split() == ["4096", "ext4:x", "restore", "200.0", "-", "40.0", "2.50x",
                                 "1.80", "2.00", "0.90", "1.50", "300.0", "1.25x", "1.50x",
                                 "ok"]
    assert lines[-1].split() == ["4096", "ext4:x", "hit50", "OutOfMemoryError()"]


def test_ttft_bench_runs_a_latent_attention_model(tmp_path):
    """``--model deepseek-v2-lite --tiny``: the example's 2-layer DeepSeek-V2, its restores
    checked bit-exact; the token-major pool path, which needs K and V heads, says why not."""
    result = tmp_path / "ttft.json"
    out = subprocess.run(
        [sys.executable, os.path.join(ROOT, "bench", "experiments", "ttft.py"), "--device",
         "cpu", "--tiny", "--model", "deepseek-v2-lite", "--tokens", "40", "--dirs",
         str(tmp_path / "store"), "--repeat", "1", "--no-decode", "--paths",
         "restore,restore_graph,restore_pool_copy", "--json", str(result)],
        capture_output=True, text=True, timeout=600, cwd="/")
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    r = json.loads(result.read_text())
    assert r["model"]["name"] == "tiny-deepseek-v2-2-layer" and r["not_bit_exact"] == []
    assert r["model"]["kv_bytes_per_token"] == 2 * (32 + 8) * 4
    assert "mla" in r["model"]["tier_layout"] and r["errors"] == []
    (run,) = r["runs"]
    for name in ("restore", "restore_graph"):
        assert run["paths"][name]["bit_exact_kv"] and run["paths"][name]["bit_exact_logits"]
        assert run["paths"][name]["restored_tokens"] == 32
    assert run["paths"]["restore_pool_copy"]["skipped"].startswith("the cache's keys and values")
