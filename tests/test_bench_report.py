"""Reports: fio's JSON field layout (checked against a real fio 3.33 sample), normal text shapes,
terse field positions. Built from synthetic results so no I/O is needed."""

from __future__ import annotations

import json
import os
import re

import pytest

from gdskv.bench.report import render, to_json, to_normal, to_terse
from gdskv.bench.measurements import FIO_PERCENTILES, DirStats, JobResult

FIXTURE = os.path.join(os.path.dirname(__file__), "fixtures", "fio_sample.json")


def _dir(n: int, nbytes: int, base_ns: int) -> DirStats:
    d = DirStats()
    for i in range(n):
        d.add(slat=1_000 + i, clat=base_ns + 37_000 * i, done=(i + 1) * 120_000_000,
              nbytes=nbytes)
    d.runtime_ns = n * 120_000_000
    return d


def _result(read: DirStats, write: DirStats, name="job", groupid=0) -> JobResult:
    return JobResult(name=name, groupid=groupid, jobs=1, read=read, write=write,
                     options={"name": name, "bs": "16M"},
                     gdskv={"engine": "gdskv", "backend": "posix", "layout": {}},
                     usr_cpu=12.5, sys_cpu=3.0, ctx=10, majf=0, minf=3, start_time=0.0)


def _type_paths(obj, prefix=""):
    """{key path: JSON type name} for every key below ``obj``."""
    out = {}
    if isinstance(obj, dict):
        for k, v in obj.items():
            path = f"{prefix}/{k}"
            out[path] = _jtype(v)
            out.update(_type_paths(v, path))
    return out


def _jtype(v) -> str:
    if isinstance(v, bool):
        return "bool"
    if isinstance(v, int):
        return "int"
    if isinstance(v, float):
        return "float"
    return type(v).__name__


@pytest.fixture(scope="module")
def fio():
    with open(FIXTURE, encoding="utf-8") as f:
        return json.load(f)


def test_fixture_is_real_fio_json(fio):
    assert fio["fio version"].startswith("fio-")
    assert fio["jobs"][0]["write"]["io_bytes"] > 0 and fio["jobs"][1]["read"]["io_bytes"] > 0


def test_json_has_fio_key_paths_and_types(fio):
    ours = to_json([_result(DirStats(), _dir(16, 1 << 20, 700_000), "w"),
                    _result(_dir(16, 1 << 20, 150_000), DirStats(), "r", 1)])
    ours = json.loads(json.dumps(ours))  # what a consumer sees
    for top in ("fio version", "timestamp", "timestamp_ms", "time", "jobs"):
        assert _jtype(ours[top]) == _jtype(fio[top]), top
    # fio job 0 wrote, job 1 read: compare the busy and the idle direction of each
    for i in (0, 1):
        for direction in ("read", "write", "trim"):
            want = _type_paths(fio["jobs"][i][direction])
            have = _type_paths(ours["jobs"][i][direction])
            missing = sorted(set(want) - set(have))
            assert not missing, f"jobs[{i}].{direction} lacks fio keys {missing}"
            wrong = {p: (have[p], t) for p, t in want.items() if have[p] != t}
            assert not wrong, f"jobs[{i}].{direction} types differ (ours, fio): {wrong}"
        for key in ("jobname", "groupid", "error", "elapsed", "job options", "job_runtime",
                    "usr_cpu", "sys_cpu", "ctx", "majf", "minf"):
            assert _jtype(ours["jobs"][i][key]) == _jtype(fio["jobs"][i][key]), key
    # same percentile list as fio's default
    assert list(ours["jobs"][0]["write"]["clat_ns"]["percentile"]) == \
        list(fio["jobs"][0]["write"]["clat_ns"]["percentile"])
    assert "gdskv" in ours["jobs"][0]


def test_json_numbers_are_consistent():
    w = _dir(10, 4 << 20, 1_000_000)
    j = to_json([_result(DirStats(), w)])["jobs"][0]["write"]
    assert j["io_bytes"] == 40 << 20 and j["io_kbytes"] == 40 << 10 and j["total_ios"] == 10
    assert j["runtime"] == 1200
    assert j["bw_bytes"] == int((40 << 20) / 1.2) and j["bw"] == j["bw_bytes"] // 1024
    assert j["iops"] == pytest.approx(10 / 1.2)
    c = j["clat_ns"]
    assert c["min"] == 1_000_000 and c["max"] == 1_000_000 + 9 * 37_000 and c["N"] == 10
    assert c["percentile"]["50.000000"] == 1_000_000 + 4 * 37_000  # nearest rank: 5th of 10
    assert c["percentile"]["99.990000"] == c["max"]
    assert j["lat_ns"]["min"] == c["min"] + 1_000
    assert j["bw_samples"] >= 1 and j["bw_min"] <= j["bw_mean"] <= j["bw_max"]


def test_normal_output_has_fio_shapes():
    text = to_normal([_result(_dir(5, 2 << 20, 2_000_000), _dir(8, 2 << 20, 300_000))])
    assert re.search(r"^job: \(groupid=0, jobs=1\): err= 0: pid=\d+: ", text, re.M)
    assert re.search(r"^  write: IOPS=[\d.]+k?, BW=[\d.]+[KMG]iB/s \([\d.]+[kMG]B/s\)"
                     r"\([\d.]+[KMG]iB/\d+msec\)$", text, re.M), text
    assert re.search(r"^   read: IOPS=", text, re.M)
    assert re.search(r"^    clat \(usec\): min=\d+, max=\d+, avg=[\d.]+, stdev=[\d.]+$", text, re.M)
    assert re.search(r"^    clat \(msec\): min=", text, re.M)  # reads are all > 1 ms
    assert "    clat percentiles (usec):" in text
    assert re.search(r"^     \|  1\.00th=\[\s*\d+\],  5\.00th=\[\s*\d+\], 10\.00th=", text, re.M)
    assert re.search(r"^     \| 99\.99th=\[\s*\d+\]$", text, re.M)
    assert "Run status group 0 (all jobs):" in text
    assert re.search(r"^  WRITE: bw=.+, io=.+, run=\d+-\d+msec$", text, re.M)
    assert re.search(r"^   READ: bw=", text, re.M)


def test_terse_v3_positions():
    line = to_terse([_result(DirStats(), _dir(4, 1 << 20, 500_000), name="t")]).strip()
    f = line.split(";")
    assert len(f) == 5 + 41 + 41 + 5
    assert f[:5] == ["3", f[1], "t", "0", "0"] and f[1].startswith("gdskv-bench")
    w = f[5 + 41:]
    assert w[0] == str(4 << 10)                          # write KiB
    assert int(w[2]) == round(4 / 0.48)                   # IOPS
    assert w[3] == "480"                                  # runtime msec
    assert w[8] == "500"                                  # clat min, usec
    assert w[12] == "1.000000%=" + str((500_000) // 1000)  # first clat percentile
    assert len([x for x in w if re.fullmatch(r"[\d.]+%=\d+", x)]) == 20  # 17 + 3 pads
    assert f[-5] == "12.500000%" and f[-4] == "3.000000%"


def test_render_several_formats_in_order():
    r = [_result(DirStats(), _dir(2, 1 << 20, 100_000))]
    text = render(r, ("terse", "json", "normal"))
    first, rest = text.split("\n", 1)
    assert first.startswith("3;gdskv-bench")
    doc, end = json.JSONDecoder().raw_decode(rest)
    assert doc["jobs"][0]["jobname"] == "job"
    assert "Run status group 0" in rest[end:]
    assert len(FIO_PERCENTILES) == 17


def _job(name: str, engine: str, backend: str, write_bw: int, read_bw: int) -> dict:
    return {"jobname": name, "job options": {"backend": backend},
            "write": {"bw_bytes": write_bw}, "read": {"bw_bytes": read_bw}, "error": 0,
            "gdskv": {"engine": engine, "backend": backend, "verify": {"ok": True},
                      "invalidate": {"done": True}}}


def test_summary_ratios_across_result_files(tmp_path):
    """device_results.sh writes HiCacheFile's job to <geometry>-hicache.json beside gdskv's and
    raw's <geometry>.json: the summary must still put gdskv over raw and over HiCacheFile."""
    from summary_table import table

    place = tmp_path / "disk"
    place.mkdir()
    gb = 10 ** 9
    (place / "llama3-8b-p16.json").write_text(json.dumps({"jobs": [
        _job("gdskv-posix", "gdskv", "posix", 2 * gb, 3 * gb),
        _job("raw-posix", "raw", "posix", 4 * gb, 4 * gb)]}))
    (place / "llama3-8b-p16-hicache.json").write_text(json.dumps({"jobs": [
        _job("hicachefile", "hicachefile", "sglang HiCacheFile", 1 * gb, gb // 2)]}))
    rows = {line.split(" | ")[2]: line.split(" | ") for line in table(str(tmp_path)).splitlines()
            if line.startswith("| disk")}
    assert set(rows) == {"gdskv-posix", "raw-posix", "hicachefile"}
    assert rows["hicachefile"][1] == "llama3-8b-p16"  # one geometry, not a "-hicache" one
    # columns: w/raw, r/raw, w/hicache, r/hicache
    assert rows["gdskv-posix"][6:10] == ["0.50", "0.75", "2.00", "6.00"]
    assert rows["raw-posix"][6:10] == ["-", "-", "4.00", "8.00"]
