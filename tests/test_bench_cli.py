"""gdskv-bench end to end on tiny sizes: modes, verify (incl. a deliberately corrupted page),
compare, job files, sweeps, the HiCacheFile engine glue."""

from __future__ import annotations

import glob
import json
import os
import re
import sys

import pytest
import torch

from gdskv.bench import cli, runner
from gdskv.bench.measurements import EILSEQ, EIO
from gdskv.bench.options import RW_MODES

# 2 layers x 2 heads x 128 dim bf16, 16 tokens: 32 KiB pages
SMALL = ["--layers=2", "--kv-heads=2", "--head-dim=128", "--page-tokens=16", "--mem=host"]


def run_json(capsys, argv, status=0) -> dict:
    rc = cli.main(argv + ["--output-format=json"])
    out, err = capsys.readouterr()
    assert rc == status, err + out
    return json.loads(out)


def test_readme_command_writes_reads_and_verifies(tmp_path, capsys):
    # The README's command, at a CI-sized size.
    doc = run_json(capsys, ["--name=llama3-8b", "--model=llama3-8b", "--page-tokens=16",
                            "--size=8M", "--bs=4M", "--rw=write", "--verify=1", "--mem=host",
                            f"--directory={tmp_path}"])
    (job,) = doc["jobs"]
    assert job["error"] == 0 and job["jobname"] == "llama3-8b"
    for direction in ("write", "read"):
        d = job[direction]
        assert d["io_bytes"] == 8 << 20 and d["total_ios"] == 2 and d["bw_bytes"] > 0
        assert d["clat_ns"]["N"] == 2 and d["clat_ns"]["min"] > 0
    g = job["gdskv"]
    assert g["verify"] == {"ok": True, "pages_checked": 4, "mismatched": 0, "missing": 0}
    assert g["engine"] == "gdskv" and g["backend"] == "posix" and g["gpu_direct"] is False
    assert g["page_bytes"] == 2 << 20 and g["layout"]["num_layers"] == 32
    assert "summary" in g["invalidate"] and isinstance(g["invalidate"]["done"], bool)
    assert os.listdir(tmp_path) == [os.path.basename(g["store"]["directories"][0])]  # kept


def _store_line(out: str) -> str:
    (line,) = [x for x in out.splitlines() if x.startswith("  store: ")]
    return line


def test_the_store_is_kept_as_fio_keeps_its_files_and_named_for_gdskv_info(tmp_path, capsys):
    from gdskv import cli as gdskv_cli
    assert cli.main(SMALL + ["--size=256k", "--bs=64k", "--rw=write",
                             f"--directory={tmp_path}"]) == 0
    line = _store_line(capsys.readouterr().out)
    (store,) = os.listdir(tmp_path)  # a directory of the job's own under the one given
    path = os.path.join(tmp_path, store)
    assert line.startswith(f"  store: kept in {path} ("), line
    assert gdskv_cli.main(["info", path, "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["pages"] == 8
    assert gdskv_cli.main(["verify", path, "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["checked"] == 8
    # the directory given is not the store, and the error names the one below it
    with pytest.raises(SystemExit) as exc:
        gdskv_cli.main(["info", str(tmp_path)])
    assert exc.value.code == 2 and f"stores in its subdirectories: {path}" in \
        capsys.readouterr().err
    # --unlink=1 removes it, and says so
    assert cli.main(SMALL + ["--size=256k", "--rw=write", "--unlink=1",
                             f"--directory={tmp_path}"]) == 0
    assert ", removed (unlink=1) (" in _store_line(capsys.readouterr().out)
    assert os.listdir(tmp_path) == [store]


def _flip_every_slot(engine) -> None:
    """Flip bytes in every page slot of every data file (between write and read phases)."""
    slot = engine.spec.layout.slot_bytes
    for path in engine.files():
        fd = os.open(path, os.O_RDWR)
        try:
            size = os.fstat(fd).st_size
            for off in range(0, size, slot):
                b = os.pread(fd, 16, off + 4096)
                os.pwrite(fd, bytes(x ^ 0xFF for x in b), off + 4096)
            os.fsync(fd)
        finally:
            os.close(fd)


@pytest.mark.parametrize("engine, tier_checksums, error, field", [
    ("gdskv", "1", EIO, "missing"),        # the tier's checksum turns it into a miss
    ("gdskv", "0", EILSEQ, "mismatched"),  # checksums off: wrong bytes reach the pool
    ("raw", "1", EILSEQ, "mismatched"),
])
def test_verify_detects_corrupted_pages(tmp_path, capsys, monkeypatch, engine, tier_checksums,
                                        error, field):
    monkeypatch.setenv("GDSKV_VERIFY", tier_checksums)
    monkeypatch.setattr(runner, "AFTER_WRITE_HOOK", _flip_every_slot)
    doc = run_json(capsys, SMALL + ["--size=1M", "--bs=256k", "--rw=write", "--verify=1",
                                    f"--ioengine={engine}", f"--directory={tmp_path}"], status=1)
    job = doc["jobs"][0]
    v = job["gdskv"]["verify"]
    assert v["ok"] is False and v[field] == 32, v
    assert job["error"] == error


def test_verify_failure_in_normal_output(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(runner, "AFTER_WRITE_HOOK", _flip_every_slot)
    rc = cli.main(SMALL + ["--size=512k", "--rw=write", "--verify=1", "--ioengine=raw",
                           f"--directory={tmp_path}"])
    out = capsys.readouterr().out
    assert rc == 1
    assert "verify: FAILED" in out and f"err={EILSEQ}" in out


@pytest.mark.parametrize("rw", ["read", "randread", "randwrite", "rw", "randrw"])
def test_modes_with_clones_and_depth(tmp_path, capsys, rw):
    doc = run_json(capsys, SMALL + [f"--rw={rw}", "--size=1M", "--bs=128k", "--numjobs=2",
                                    "--iodepth=2", "--rwmixread=50", "--verify=1",
                                    "--ioengine=raw", f"--directory={tmp_path}"])
    assert [j["jobname"] for j in doc["jobs"]] == ["gdskv", "gdskv"]  # one per clone
    for job in doc["jobs"]:
        assert job["error"] == 0, job["gdskv"]
        r, w = job["read"]["io_bytes"], job["write"]["io_bytes"]
        if rw in ("read", "randread"):
            assert r == 1 << 20 and w == 0
        elif rw == "randwrite":
            assert w == 1 << 20 and r == 1 << 20  # verify reads back
        else:
            assert r + w == 1 << 20 and job["read"]["runtime"] == job["write"]["runtime"]


# Sizes of one to three 1-page calls. A mix whose draws are all writes (the default seed's two
# draws are, and rwmixread=0 always) read nothing, so verify once failed with pages_checked=0.
MIXED = ("rw", "readwrite", "randrw")


@pytest.mark.parametrize("size", ["32k", "64k", "96k"])
@pytest.mark.parametrize("rw, rwmixread", [(rw, 50) for rw in RW_MODES]
                         + [(rw, 0) for rw in MIXED])
def test_every_mode_verifies_every_page_of_a_small_job(tmp_path, capsys, rw, size, rwmixread):
    doc = run_json(capsys, SMALL + [f"--rw={rw}", f"--size={size}", "--bs=32k",
                                    f"--rwmixread={rwmixread}", "--verify=crc32c",
                                    f"--directory={tmp_path}"])
    (job,) = doc["jobs"]
    pages = int(size[:-1]) // 32
    assert job["error"] == 0, job["gdskv"]
    assert job["gdskv"]["verify"] == {"ok": True, "pages_checked": pages, "mismatched": 0,
                                      "missing": 0}
    if rw in MIXED:  # the mix's own calls, the read-back not among them
        assert job["read"]["total_ios"] + job["write"]["total_ios"] == pages


def test_time_based_runtime_and_ramp(tmp_path, capsys):
    doc = run_json(capsys, SMALL + ["--rw=randread", "--size=512k", "--bs=64k", "--time_based",
                                    "--runtime=600ms", "--ramp_time=100ms",
                                    "--group_reporting", "--numjobs=2",
                                    f"--directory={tmp_path}"])
    (job,) = doc["jobs"]
    rd = job["read"]
    assert rd["io_bytes"] > 512 << 10  # more than one pass over the pages
    assert 300 <= rd["runtime"] <= 2500
    assert job["error"] == 0


def test_compare_prints_ratios_and_names_engines(tmp_path, capsys, monkeypatch):
    monkeypatch.setitem(sys.modules, "sglang", None)  # hicachefile absent: skipped, said so
    rc = cli.main(SMALL + ["--size=1M", "--rw=write", "--verify=1", "--compare",
                           f"--directory={tmp_path}"])
    out = capsys.readouterr().out
    assert rc == 0
    assert "gdskv.gdskv: (groupid=0" in out and "gdskv.raw: (groupid=1" in out
    assert "hicachefile skipped" in out
    assert "Compare gdskv:" in out and "gdskv/raw=" in out
    # the compare lines in the units of the reports above them: fio's MiB/s (MB/s)
    (write,) = [x for x in out.splitlines() if x.startswith("  write: gdskv=")]
    assert re.match(r"  write: gdskv=[\d.]+[KMG]iB/s \([\d.]+[kMG]B/s\), raw=[\d.]+[KMG]iB/s",
                    write), write
    doc = run_json(capsys, SMALL + ["--size=1M", "--rw=write", "--compare",
                                    f"--directory={tmp_path}"])
    (cmp_,) = doc["gdskv_compare"]
    assert set(cmp_["bw_bytes"]["write"]) == {"gdskv", "raw"}
    assert cmp_["ratios"]["write: gdskv/raw"] > 0


def test_job_file_output_file_and_formats(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("BENCH_DIR", str(tmp_path))
    jobs = tmp_path / "j.ini"
    jobs.write_text("[global]\nlayers=2\nkv_heads=1\nhead_dim=128\nmem=host\n"
                    "directory=${BENCH_DIR}\nsize=512k\nbs=128k\n"
                    "[w]\nrw=write\n[r]\nrw=read\nioengine=raw\n")
    out_file = tmp_path / "report.txt"
    rc = cli.main([str(jobs), "--output-format=terse,json", f"--output={out_file}"])
    assert rc == 0
    assert capsys.readouterr().out == ""
    text = out_file.read_text()
    terse, rest = text.split("\n", 2)[:2], text.split("\n", 2)[2]
    assert [t.split(";")[2] for t in terse] == ["w", "r"]
    doc = json.loads(rest)
    assert [j["jobname"] for j in doc["jobs"]] == ["w", "r"]
    assert [j["groupid"] for j in doc["jobs"]] == [0, 1]
    assert doc["jobs"][1]["gdskv"]["engine"] == "raw"
    assert doc["jobs"][0]["job options"]["size"] == "512k"


def test_sweep_writes_json_per_point_and_png(tmp_path, capsys):
    sweep_dir = tmp_path / "sweep"
    rc = cli.main(SMALL + ["--size=512k", "--rw=write", "--sweep=bs=64k,256k",
                           f"--sweep-dir={sweep_dir}", f"--directory={tmp_path}"])
    out = capsys.readouterr().out
    assert rc == 0
    files = sorted(os.listdir(sweep_dir))
    assert files == ["sweep-bs.png", "sweep-bs=256k.json", "sweep-bs=64k.json"]
    doc = json.loads((sweep_dir / "sweep-bs=64k.json").read_text())
    assert doc["gdskv_sweep"] == {"key": "bs", "value": "64k"}
    assert doc["jobs"][0]["gdskv"]["pages_per_batch"] == 2
    assert "Sweep over bs" in out and "gdskv/posix write" in out
    (row,) = [x for x in out.splitlines() if x.startswith("  gdskv/posix write")]
    assert re.search(r"64k=[\d.]+[KMG]iB/s \([\d.]+[kMG]B/s\)  256k=", row), row


def test_normal_report_units_plurals_and_one_boolean_style(tmp_path, capsys):
    # bs of 40k with 32 KiB pages: one whole page per call
    rc = cli.main(SMALL + ["--size=64k", "--bs=40k", "--rw=write", f"--directory={tmp_path}"])
    out = capsys.readouterr().out
    assert rc == 0
    assert "note: bs=40k (40KiB) rounded to 1 whole page of 32KiB" in out
    assert "batch=1 page," in out
    gdskv_lines = [x for x in out.splitlines() if x.startswith(("  gdskv:", "  store:"))]
    assert len(gdskv_lines) == 2
    assert "gpu_direct=no" in gdskv_lines[0] and re.search(r"O_DIRECT=(yes|no)", gdskv_lines[0])
    assert not re.search(r"=(True|False|0|1)\b", " ".join(gdskv_lines)), gdskv_lines


# 32 KiB pages. fio's kb_base=1024 rule: KiB = 1000, k = 1024.
@pytest.mark.parametrize("argv, io_bytes, note", [
    (["--size=64KiB", "--bs=32k"], 32 << 10,
     "size=64KiB (64000 bytes: KiB = 1000^1 with kb_base=1024, as fio) rounded down to 32KiB: "
     "1 call of 32KiB (1 page), as a job moves whole calls"),
    (["--size=100k", "--bs=64k"], 64 << 10,
     "size=100k (100KiB) rounded down to 64KiB: 1 call of 64KiB (2 pages), as a job moves "
     "whole calls"),
    (["--size=64k", "--bs=4k"], 64 << 10, "bs=4k (4KiB) is less than one page (32KiB): 1 page "
     "per call"),
    (["--size=64k", "--bs=32k"], 64 << 10, ""),  # nothing rounded, nothing said
])
def test_what_was_rounded_is_said_in_one_line(tmp_path, capsys, argv, io_bytes, note):
    doc = run_json(capsys, SMALL + argv + ["--rw=write", f"--directory={tmp_path}"])
    (job,) = doc["jobs"]
    assert job["write"]["io_bytes"] == io_bytes and job["gdskv"]["note"] == note
    assert cli.main(SMALL + argv + ["--rw=write", f"--directory={tmp_path}"]) == 0
    notes = [x for x in capsys.readouterr().out.splitlines() if x.startswith("  note: ")]
    assert notes == ([f"  note: {note}"] if note else [])


def test_break_even_in_report(tmp_path, capsys):
    doc = run_json(capsys, ["--model=qwen2.5-7b", "--layers=2", "--page-tokens=16",
                            "--size=1M", "--rw=write", "--verify=1", "--mem=host",
                            "--prefill-tflops=300", f"--directory={tmp_path}"])
    be = doc["jobs"][0]["gdskv"]["break_even"]
    # FLOPs per token come from the full preset (7.62e9 params), bytes from the layout used
    assert be["flops_per_token"] == pytest.approx(2 * 7.62e9)
    assert be["recompute_us_per_token"] == pytest.approx(2 * 7.62e9 / 300e12 * 1e6)
    assert be["restore_us_per_token"] > 0 and be["break_even_bytes_per_s"] > 0


def test_progress_only_on_a_tty_in_normal_mode(monkeypatch):
    from gdskv.bench.options import parse_args
    monkeypatch.setattr(sys.stderr, "isatty", lambda: True)
    assert cli._make_progress(parse_args([]))[0] is not None
    assert cli._make_progress(parse_args(["--output-format=json"]))[0] is None
    monkeypatch.setattr(sys.stderr, "isatty", lambda: False)
    assert cli._make_progress(parse_args([]))[0] is None


# -- SGLang HiCacheFile engine glue -------------------------------------------------------------

def _real_hicache_available() -> bool:
    try:
        import sglang.srt.mem_cache.hicache_storage  # noqa: F401
    except Exception:  # noqa: BLE001 - any import failure means "not here"
        return False
    return True


@pytest.mark.skipif(not _real_hicache_available(),
                    reason="needs the real sglang package (run in .venv-sglang: tests/run_sglang.sh)")
def test_hicachefile_engine_on_the_real_class(tmp_path, capsys, monkeypatch):
    doc = run_json(capsys, SMALL + ["--size=1M", "--bs=256k", "--rw=randwrite", "--verify=1",
                                    "--ioengine=hicachefile", "--time_based", "--runtime=300ms",
                                    f"--directory={tmp_path}"])
    job = doc["jobs"][0]
    assert job["error"] == 0 and job["gdskv"]["verify"]["ok"] is True
    assert job["write"]["io_bytes"] >= 1 << 20 and "HiCacheFile" in job["gdskv"]["backend"]
    # corruption of a page file is caught too (HiCacheFile has no checksum)
    monkeypatch.setattr(runner, "AFTER_WRITE_HOOK", lambda e: [
        open(p, "r+b").write(b"\xff" * 64) for p in glob.glob(os.path.join(e.path, "*.bin"))])
    doc = run_json(capsys, SMALL + ["--size=512k", "--rw=write", "--verify=1",
                                    "--ioengine=hicachefile", f"--directory={tmp_path}"],
                   status=1)
    assert doc["jobs"][0]["gdskv"]["verify"]["mismatched"] == 16


def test_a_job_that_cannot_run_is_reported_and_others_go_on(tmp_path, capsys, monkeypatch):
    real = runner.make_engine

    def make_engine(kind, spec):
        if spec.name == "bad":
            raise RuntimeError("backend 'nixl' is not available: no agent")
        return real(kind, spec)

    monkeypatch.setattr(runner, "make_engine", make_engine)
    jobs = tmp_path / "j.ini"
    jobs.write_text(f"[global]\nlayers=2\nkv_heads=1\nhead_dim=128\nmem=host\n"
                    f"directory={tmp_path}\nsize=256k\nrw=write\n[bad]\n[good]\n")
    rc = cli.main([str(jobs), "--output-format=json"])
    out, err = capsys.readouterr()
    doc = json.loads(out)
    assert rc == 1
    bad, good = doc["jobs"]
    assert bad["error"] != 0 and "not available" in bad["gdskv"]["failed"]
    assert "job 'bad'" in err and "not available" in err
    assert good["error"] == 0 and good["write"]["io_bytes"] == 256 << 10


def test_call_profile_phases_and_threads(tmp_path):
    """bench/experiments/call_profile.py: gdskv and raw per-call times, and the tier's steps timed in the
    calling thread, the first write call on its own."""
    import call_profile

    out = tmp_path / "profile.json"
    call_profile.main(["--directory", str(tmp_path), "--bs", "4M", "--size", "16M",
                       "--backend", "posix", "--phases", "--json", str(out)])
    res = json.loads(out.read_text())
    assert res["calls"] == 4 and res["iodepth"] == 1
    for kind in ("gdskv", "raw"):
        e = res["engines"][kind]
        assert len(e["write_ms"]) == 4 and e["read_gbps"] > 0 and e["write_gbps"] > 0
    phases = res["gdskv_phases_ms_per_call"]
    assert phases["gdskv.tier:Tier._run"] > 0
    assert phases["gdskv.tier:Tier._run"] >= phases["gdskv.restore_call:RestoreCall._finish_read"]
    assert "gdskv.tier:Tier._run" in res["gdskv_first_write_phases_ms"]


def test_compare_sets_completion_latency_percentiles_side_by_side(tmp_path, capsys, monkeypatch):
    """Issue 14: --compare gives each engine's clat p50/p90/p99/p99.9 per call and the
    gdskv/raw ratio of each, in the normal summary and in the JSON."""
    monkeypatch.setitem(sys.modules, "sglang", None)
    doc = run_json(capsys, SMALL + ["--size=1M", "--rw=write", "--compare",
                                    f"--directory={tmp_path}"])
    (cmp_,) = doc["gdskv_compare"]
    clat = cmp_["clat_ns"]["write"]
    assert set(clat) == {"gdskv", "raw"}
    for engine in ("gdskv", "raw"):
        assert list(clat[engine]) == ["p50", "p90", "p99", "p99.9"]
        assert 0 < clat[engine]["p50"] <= clat[engine]["p99"] <= clat[engine]["p99.9"]
        # the same numbers as that engine's own fio-style report
        job = next(j for j in doc["jobs"] if j["jobname"].endswith(f".{engine}"))
        assert clat[engine]["p99"] == job["write"]["clat_ns"]["percentile"]["99.000000"]
    assert cmp_["ratios"]["write: clat p50 gdskv/raw"] == clat["gdskv"]["p50"] / clat["raw"]["p50"]
    cli.main(SMALL + ["--size=1M", "--rw=write", "--compare", f"--directory={tmp_path}"])
    out = capsys.readouterr().out
    assert re.search(r"clat   p50: gdskv=\d+us, raw=\d+us  \(gdskv/raw=[\d.]+x\)", out), out


def test_compare_rounds_alternate_the_engines_and_pool_their_calls(tmp_path, capsys,
                                                                     monkeypatch):
    """--compare-rounds 2: gdskv, raw, then raw, gdskv (ABBA); each run reported under its own
    name; the comparison pools both rounds' calls (clat) and averages their bandwidth, and
    gives each round's ratios too."""
    monkeypatch.setitem(sys.modules, "sglang", None)
    doc = run_json(capsys, SMALL + ["--size=1M", "--rw=write", "--compare",
                                    "--compare-rounds=2", f"--directory={tmp_path}"])
    names = [j["jobname"] for j in doc["jobs"]]
    assert names == ["gdskv.gdskv.r1", "gdskv.raw.r1", "gdskv.raw.r2", "gdskv.gdskv.r2"]
    assert [j["groupid"] for j in doc["jobs"]] == [0, 1, 2, 3]
    (cmp_,) = doc["gdskv_compare"]
    assert cmp_["rounds"] == 2 and len(cmp_["ratios_by_round"]) == 2
    for engine in ("gdskv", "raw"):
        runs = [j for j in doc["jobs"] if j["jobname"].startswith(f"gdskv.{engine}.")]
        p50s = [j["write"]["clat_ns"]["percentile"]["50.000000"] for j in runs]
        assert min(p50s) <= cmp_["clat_ns"]["write"][engine]["p50"] <= max(p50s)
        assert cmp_["bw_bytes"]["write"][engine] == sum(j["write"]["bw_bytes"]
                                                        for j in runs) // 2
    for rnd, r in zip(cmp_["ratios_by_round"], (1, 2)):
        g, w = (next(j for j in doc["jobs"] if j["jobname"] == f"gdskv.{e}.r{r}")
                for e in ("gdskv", "raw"))
        assert rnd["write: gdskv/raw"] == g["write"]["bw_bytes"] / w["write"]["bw_bytes"]
    cli.main(SMALL + ["--size=1M", "--rw=write", "--compare", "--compare-rounds=2",
                      f"--directory={tmp_path}"])
    out = capsys.readouterr().out
    assert "Compare gdskv (2 rounds, ABBA" in out
    assert re.search(r"by round, clat p50 gdskv/raw: [\d.]+x [\d.]+x", out), out


def test_compare_rounds_need_compare(tmp_path, capsys):
    rc = cli.main(SMALL + ["--size=1M", "--compare-rounds=3", f"--directory={tmp_path}"])
    assert rc == 2
    assert "add --compare" in capsys.readouterr().err


def test_metrics_port_serves_gdskv_metrics_during_the_run(tmp_path):
    """gdskv-bench --metrics-port: the run's tier counters at /metrics while it runs."""
    import socket
    import subprocess
    import time
    import urllib.request
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    exe = os.path.join(os.path.dirname(sys.executable), "gdskv-bench")
    proc = subprocess.Popen([exe] + SMALL + [
        "--rw=randread", "--size=512k", "--bs=64k", "--time_based", "--runtime=20s",
        f"--directory={tmp_path}", f"--metrics-port={port}"], stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE)
    try:
        t0, text = time.monotonic(), ""
        while time.monotonic() - t0 < 60 and "gdskv_pages_total{" not in text:
            assert proc.poll() is None, proc.stderr.read().decode()
            time.sleep(0.3)
            try:
                text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics",
                                              timeout=5).read().decode()
            except OSError:
                continue
        got = [line for line in text.splitlines()
               if line.startswith("gdskv_pages_total{") and 'event="got"' in line]
        assert got and float(got[0].split()[-1]) > 0, text[:2000]
    finally:
        proc.kill()
        proc.wait()


@pytest.mark.parametrize("value, says", [("0", "0 is not a port number: give 1..65535"),
                                         ("http", "'http' is not a port number")])
def test_metrics_port_bad_value(capsys, value, says):
    assert cli.main([f"--metrics-port={value}", "--rw=write"]) == 2
    err = capsys.readouterr().err
    assert "--metrics-port" in err and says in err, err


@pytest.mark.parametrize("raw_io", ["pool", "caller"])
def test_raw_io_picks_the_raw_engines_path(tmp_path, capsys, monkeypatch, raw_io):
    """``raw_io=caller``: the raw engine's 1-page calls move on the calling thread
    (``Backend.move_on_caller``), as gdskv's do; ``pool`` (the default): never. Either way
    every byte comes back."""
    from gdskv.backends.posix import PosixBackend

    moved: list[str] = []
    real = PosixBackend.move_on_caller

    def spied(self, op, buffer, extents):
        done = real(self, op, buffer, extents)
        moved.append(op if done is not None else "none")
        return done

    monkeypatch.setattr(PosixBackend, "move_on_caller", spied)
    doc = run_json(capsys, SMALL + ["--size=256K", "--bs=32K", "--rw=write", "--verify=1",
                                    "--ioengine=raw", "--backend=posix", f"--raw_io={raw_io}",
                                    f"--directory={tmp_path}"])
    (job,) = doc["jobs"]
    assert job["error"] == 0 and job["write"]["io_bytes"] == 256 * 1024
    if raw_io == "pool":
        assert moved == []
    else:  # 8 writes and the verify's 8 reads, each one page
        assert moved.count("write") == 8 and moved.count("read") >= 8 and "none" not in moved


def test_raw_io_refuses_other_values(capsys):
    assert cli.main(SMALL + ["--rw=write", "--raw_io=thread"]) == 2
    assert "raw_io" in capsys.readouterr().err
