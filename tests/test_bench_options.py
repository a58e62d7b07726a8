"""gdskv-bench option parsing: fio names, job files, and one clear error (status 2) per bad input."""

from __future__ import annotations

import glob
import os
import re
import sys

import pytest

from gdskv.bench import cli
from gdskv.bench.options import OptionError, fio_size, parse_args, read_job_file
from gdskv.bench.placement import SetupError
from gdskv.bench.runner import resolve
from gdskv.memory import cuda_available

JOBS_DIR = os.path.join(os.path.dirname(__file__), "..", "bench", "jobs")


def _error(capsys, argv) -> str:
    assert cli.main(argv) == 2
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.startswith("gdskv-bench: error:")]
    assert len(lines) == 1, err
    return lines[0]


def test_fio_names_and_kv_options():
    inv = parse_args(["--name=j", "--rw=randread", "--bs=1M", "--size=64M", "--numjobs=2",
                      "--iodepth=4", "--runtime=500ms", "--time_based", "--ramp-time=1",
                      "--direct=0", "--group_reporting", "--model=llama3-8b",
                      "--page-tokens=64", "--kv_heads=4", "--output-format=json,terse"])
    (job,) = inv.jobs
    assert (job.name, job.rw, job.bs, job.size) == ("j", "randread", 1 << 20, 64 << 20)
    assert (job.numjobs, job.iodepth, job.runtime, job.ramp_time) == (2, 4, 0.5, 1.0)
    assert job.time_based is True and job.direct is False and job.group_reporting is True
    assert (job.model, job.page_tokens, job.kv_heads) == ("llama3-8b", 64, 4)
    assert inv.output_format == ("json", "terse")
    # fio's "job options" keep the text as given
    assert job.given["bs"] == "1M" and job.given["runtime"] == "500ms"
    assert job.rwmixread == 50 and job.ioengine == "gdskv"  # defaults


def test_one_default_for_bs_64m_in_the_parser_the_plan_and_the_docs():
    (job,) = parse_args(["--model=llama3-8b"]).jobs
    assert job.bs == 64 << 20 and "bs" not in job.given
    plan = resolve(job)
    assert plan.pages_per_batch == (64 << 20) // plan.layout.page_bytes == 32  # 2 MiB pages
    assert "default 64M" in " ".join(cli.build_parser().format_help().split())
    with open(os.path.join(JOBS_DIR, "..", "README.md"), encoding="utf-8") as f:
        assert "(default 64M" in f.read()


# What fio 3.33 wrote for --size=400<unit> (io_bytes at bs=1), under each kb_base: fio's
# default inverts IEC and SI ("for compatibility"), kb_base=1000 reads them as written.
@pytest.mark.parametrize("kb_base, unit, nbytes", [
    (1024, "k", 409600), (1024, "K", 409600), (1024, "KB", 409600), (1024, "kb", 409600),
    (1024, "KiB", 400000), (1024, "kib", 400000),
    (1000, "k", 400000), (1000, "KB", 400000), (1000, "KiB", 409600), (1000, "kib", 409600),
])
def test_sizes_follow_fio_units_and_kb_base(kb_base, unit, nbytes):
    argv = [f"--size=400{unit}"] + ([f"--kb_base={kb_base}"] if kb_base != 1024 else [])
    assert parse_args(argv).jobs[0].size == nbytes
    assert parse_args(["--size=1G"]).jobs[0].size == 1 << 30


def test_help_states_the_units_the_parser_uses():
    """--help once said KB/MB/GB = 1000^n while --size=64MB read as 64 MiB (fio's rule)."""
    text = " ".join(cli.build_parser().format_help().split())
    claims = re.findall(r"([A-Za-z/]+) = (1024|1000)\^n", text)
    said = {unit: int(base) for units, base in claims for unit in units.split("/")}
    assert {"k", "KB", "MB", "GB", "KiB", "MiB", "GiB"} <= set(said), claims
    powers = {"k": 1, "m": 2, "g": 3}
    for unit, base in said.items():
        assert fio_size("1" + unit) == base ** powers[unit[0].lower()], unit


def test_kb_base_in_a_job_file_applies_to_its_sizes(tmp_path):
    path = tmp_path / "j.ini"
    path.write_text("[global]\nkb_base=1000\n[j]\nsize=64MB\nbs=1MiB\n")
    (job,) = read_job_file(str(path))
    assert (job.size, job.bs) == (64_000_000, 1 << 20)
    (job,) = parse_args([str(path), "--kb_base=1024"]).jobs  # the command line wins
    assert (job.size, job.bs) == (64 << 20, 1_000_000)


@pytest.mark.parametrize("argv, names", [
    (["--frobnicate=3"], ["--frobnicate=3"]),
    (["--bs=12X"], ["--bs", "'12X'"]),
    (["--size=1.5.5G"], ["--size", "'1.5.5G'"]),
    (["--rwmixread=101"], ["--rwmixread", "101"]),
    (["--rwmixread=-1"], ["--rwmixread", "-1"]),
    (["--rw=sideways"], ["--rw", "sideways"]),
    (["--ioengine=libaio"], ["--ioengine", "libaio"]),
    (["--model=gpt5"], ["--model", "gpt5"]),
    (["--output-format=xml"], ["--output-format", "xml"]),
    (["--sweep=bs"], ["--sweep", "bs"]),
    (["--sweep=rw=read,write"], ["--sweep", "numeric"]),
])
def test_bad_options_exit_2_naming_option_and_value(capsys, argv, names):
    line = _error(capsys, argv)
    for n in names:
        assert n in line, line


def test_hicachefile_without_sglang_is_refused(capsys, monkeypatch):
    # None in sys.modules makes `import sglang` fail even where sglang is installed.
    monkeypatch.setitem(sys.modules, "sglang", None)
    line = _error(capsys, ["--ioengine=hicachefile", "--model=llama3-8b", "--size=8M"])
    assert "ioengine=hicachefile" in line and "sglang" in line


def test_semantic_errors_name_the_option(capsys):
    assert "time_based" in _error(capsys, ["--model=llama3-8b", "--time_based"])
    assert "--model" in _error(capsys, ["--layers=4"])  # no geometry
    assert "size" in _error(capsys, ["--model=llama3-8b", "--size=4k"])  # below one page
    assert "prefill_tflops" in _error(capsys, ["--layers=2", "--head-dim=64", "--kv-heads=1",
                                               "--prefill-tflops=100"])


def test_job_file_global_sections_bare_keys_env(tmp_path, monkeypatch):
    monkeypatch.setenv("BENCH_DIR", str(tmp_path))
    monkeypatch.setenv("BENCH_SIZE", "32M")
    path = tmp_path / "jobs.ini"
    path.write_text(
        "; a fio-style job file\n"
        "[global]\n"
        "model=llama3-8b\n"
        "directory=${BENCH_DIR}\n"
        "size=${BENCH_SIZE}\n"
        "group_reporting\n"
        "# comment\n"
        "[spill]\n"
        "rw=write\n"
        "time-based\n"
        "runtime=2\n"
        "[restore]\n"
        "rw=read\n"
        "page_tokens=64\n")
    a, b = read_job_file(str(path))
    assert (a.name, a.rw, a.size, a.directory) == ("spill", "write", 32 << 20, str(tmp_path))
    assert a.group_reporting is True and a.time_based is True and a.runtime == 2.0
    assert (b.name, b.rw, b.page_tokens, b.time_based) == ("restore", "read", 64, False)
    # command-line job options override the file
    inv = parse_args([str(path), "--size=16M"])
    assert [j.size for j in inv.jobs] == [16 << 20, 16 << 20]
    assert [j.name for j in inv.jobs] == ["spill", "restore"]


@pytest.mark.parametrize("body, needle", [
    ("[j]\nbogus=1\n", "unknown option 'bogus'"),
    ("[j]\nbs=9Q\n", "bs=9Q"),
    ("[j]\ndirectory=${GDSKV_BENCH_SURELY_UNSET}\n", "GDSKV_BENCH_SURELY_UNSET"),
    ("[global]\nsize=1M\n", "no job sections"),
    ("[j]\nrwmixread=200\n", "rwmixread=200"),
    ("[j]\nsize\n", "needs a value"),
])
def test_job_file_errors(tmp_path, capsys, body, needle):
    path = tmp_path / "bad.ini"
    path.write_text(body)
    with pytest.raises(OptionError) as info:
        read_job_file(str(path))
    assert needle in str(info.value)
    line = _error(capsys, [str(path)])
    assert needle in line


def test_example_job_files_parse_and_resolve(tmp_path, monkeypatch):
    for var, value in (("DIR", str(tmp_path)), ("MODEL", "llama3-8b"), ("PAGES", "16"),
                       ("SIZE", "64M"), ("BS", "16M"), ("MEM", "host"), ("IODEPTH", "2")):
        monkeypatch.setenv(var, value)
    files = sorted(glob.glob(os.path.join(JOBS_DIR, "*.ini")))
    assert len(files) >= 3
    for path in files:
        for job in read_job_file(path):
            job = job.replace(mem="host") if job.mem == "gpu" else job
            engine = "gdskv" if job.ioengine == "hicachefile" else None
            if job.backend == "kvikio" and not cuda_available():
                with pytest.raises(SetupError, match="backend=kvikio.*CUDA"):
                    resolve(job, engine)
                continue
            plan = resolve(job, engine)
            assert plan.batches >= 1 and plan.pages_per_batch >= 1


def test_resolve_geometry_from_preset_and_overrides():
    plan = resolve(parse_args(["--model=llama3-8b", "--page-tokens=16", "--bs=16M",
                               "--size=64M"]).jobs[0])
    assert plan.layout.page_bytes == 2 * 32 * 16 * 8 * 128 * 2  # 2 MiB
    assert (plan.pages_per_batch, plan.batches) == (8, 4)
    plan = resolve(parse_args(["--model=deepseek-v3", "--size=64M"]).jobs[0])
    assert plan.layout.mla and plan.layout.page_bytes == 61 * 16 * 576 * 2
    plan = resolve(parse_args(["--model=llama3-8b", "--layers=2", "--dtype=fp8",
                               "--size=8M"]).jobs[0])
    assert plan.layout.num_layers == 2 and plan.layout.itemsize == 1


@pytest.mark.parametrize("text, want", [("crc32c", True), ("md5", True), ("xxhash", True),
                                        ("sha3-256", True), ("1", True), ("0", False),
                                        ("null", False)])
def test_verify_takes_fios_method_names(text, want):
    assert parse_args([f"--verify={text}"]).jobs[0].verify is want


def test_unknown_verify_method_lists_fios(capsys):
    line = _error(capsys, ["--verify=crc33"])
    assert "--verify" in line and "'crc33'" in line and "crc32c" in line


@pytest.mark.parametrize("argv, needle", [
    (["--filename=/dev/nvme0n1"], "give --directory=DIR"),
    (["--pagetokens=16"], "'--pagetokens=16' (did you mean --page-tokens?)"),
    (["--iodpeth=4"], "(did you mean --iodepth?)"),
])
def test_fio_habits_get_a_hint(capsys, argv, needle):
    assert needle in _error(capsys, argv + ["--model=llama3-8b"])


@pytest.mark.parametrize("body, needle", [
    ("[j]\nsize=1M\nthis is not ini\n", "bad.ini:3 [j] unknown option 'this is not ini'"),
    ("size=1M\n[j]\n", "bad.ini:1: 'size=1M' comes before any [section] header"),
    ("[j]\nsize=1M\nsize=2M\n", "bad.ini:3"),
    ("[j]\nmodel=llama3-8b\npagetokens=16\n", "bad.ini:3 [j] unknown option 'pagetokens' "
                                              "(did you mean page_tokens?)"),
    ("[j]\nfilename=/dev/nvme0n1\n", "bad.ini:2 [j] unknown option 'filename': "),
    ("[global]\nmodel=llama3-8b\n\n[j]\nbs=9Q\n", "bad.ini:5 [j] option bs=9Q"),
])
def test_job_file_errors_name_the_line(tmp_path, capsys, body, needle):
    path = tmp_path / "bad.ini"
    path.write_text(body)
    assert needle in _error(capsys, [str(path)])


@pytest.mark.parametrize("name, rw", [("latency.ini", "read"), ("spill-latency.ini", "write")])
def test_latency_job_files_cover_the_small_call_table(tmp_path, monkeypatch, name, rw):
    """bench/jobs/latency.ini and spill-latency.ini (issue 14): restores / spills of 1, 8 and
    128 pages, one and four calls in flight, kvikio from GPU memory."""
    monkeypatch.setenv("DIR", str(tmp_path))
    jobs = read_job_file(os.path.join(JOBS_DIR, name))
    seen = set()
    for job in jobs:
        assert (job.backend, job.mem, job.rw) == ("kvikio", "gpu", rw)
        plan = resolve(job.replace(mem="host", backend="posix"))
        seen.add((plan.pages_per_batch, job.iodepth))
    assert seen == {(p, q) for p in (1, 8, 128) for q in (1, 4)}


def test_a_bare_boolean_option_leaves_the_next_word_a_job_file():
    """``gdskv-bench --compare jobs.ini`` (as fio reads a bare boolean): the job file is a job
    file, not --compare's value; a boolean word after it is still its value."""
    latency = os.path.join(JOBS_DIR, "latency.ini")
    env = {"DIR": "/tmp"}
    inv = parse_args(["--compare", latency], env)
    assert inv.compare is True
    assert [j.values["name"] for j in inv.jobs][:2] == ["page1", "page8"]
    assert parse_args(["--compare", "0", latency], env).compare is False
    (job,) = parse_args(["--time_based", "--runtime=1s"]).jobs
    assert job.values["time_based"] is True
