"""gdskv-bench and the machine it runs on: the GDSKV_* environment (command line over job file
over environment, as fio), where the report says it wrote, whose page cache it drops, and the
setups it refuses up front in one line (kvikio without CUDA, a read-only or full directory)."""

from __future__ import annotations

import json
import os

import pytest

from gdskv.bench import cache, cli, placement
from gdskv.bench.options import parse_args
from gdskv.bench.runner import resolve
from gdskv.memory import cuda_available

# 2 layers x 2 heads x 128 dim bf16, 16 tokens: 32 KiB pages
SMALL = ["--layers=2", "--kv-heads=2", "--head-dim=128", "--page-tokens=16", "--mem=host"]


def _run(capsys, argv, status=0) -> tuple[str, str]:
    rc = cli.main(argv)
    out, err = capsys.readouterr()
    assert rc == status, err + out
    return out, err


def _job(capsys, argv) -> dict:
    out, _ = _run(capsys, argv + ["--output-format=json"])
    (job,) = json.loads(out)["jobs"]
    return job


@pytest.fixture
def no_gdskv_env(monkeypatch):
    for var in [v for v in os.environ if v.startswith("GDSKV_")]:
        monkeypatch.delenv(var)


def test_the_bench_takes_the_tiers_environment(tmp_path, capsys, monkeypatch, no_gdskv_env):
    """The issue's case: GDSKV_DIRECTORIES, _CAPACITY, _DIRECT_IO and _BACKEND were ignored."""
    store = tmp_path / "nvme"
    store.mkdir()
    monkeypatch.setenv("GDSKV_DIRECTORIES", str(store))
    monkeypatch.setenv("GDSKV_CAPACITY", "8MiB")
    monkeypatch.setenv("GDSKV_DIRECT_IO", "off")
    monkeypatch.setenv("GDSKV_BACKEND", "posix")
    monkeypatch.setenv("GDSKV_IO_THREADS", "3")
    g = _job(capsys, SMALL + ["--size=1M", "--rw=write", "--verify=1", "--unlink=0"])["gdskv"]
    assert [os.path.dirname(d) for d in g["directories"]] == [str(store)]
    assert g["store"]["directories_from"] == "GDSKV_DIRECTORIES"
    assert g["store"]["capacity_from"] == "GDSKV_CAPACITY"
    assert g["config"]["capacity"] == 8 << 20 and g["config"]["direct_io"] == "off"
    assert g["config"]["backend"] == "posix" and g["config"]["io_threads"] == 3
    assert g["o_direct"] is False and g["verify"]["ok"] is True
    assert os.listdir(g["directories"][0])  # the store really is there


def test_command_line_over_job_file_over_environment(tmp_path, monkeypatch, no_gdskv_env):
    a, b, c = (tmp_path / n for n in "abc")
    for d in (a, b, c):
        d.mkdir()
    monkeypatch.setenv("GDSKV_DIRECTORIES", str(a))
    monkeypatch.setenv("GDSKV_DIRECT_IO", "off")
    jobs = tmp_path / "j.ini"
    jobs.write_text(f"[global]\nlayers=2\nkv_heads=1\nhead_dim=128\nmem=host\nsize=1M\n"
                    f"[j]\ndirectory={b}\ndirect=1\n")

    def placed(argv):
        return resolve(parse_args(argv).jobs[0]).placement

    p = placed(SMALL + ["--size=1M"])
    assert p.base_dirs == (str(a),) and p.dirs_from == "GDSKV_DIRECTORIES"
    assert p.config.direct_io.value == "off"
    p = placed([str(jobs)])
    assert p.base_dirs == (str(b),) and p.dirs_from == f"{jobs}:8 [j]"
    assert p.config.direct_io.value == "auto"  # direct=1 in the file beats GDSKV_DIRECT_IO
    p = placed([str(jobs), f"--directory={c}", "--direct=0"])
    assert p.base_dirs == (str(c),) and p.dirs_from == "command line"
    assert p.config.direct_io.value == "off"


def test_bad_environment_is_one_error_naming_the_variable(capsys, monkeypatch, no_gdskv_env):
    monkeypatch.setenv("GDSKV_CAPACTIY", "1G")
    _, err = _run(capsys, SMALL + ["--size=1M"], status=2)
    assert "GDSKV_CAPACTIY='1G' (did you mean GDSKV_CAPACITY?)" in err
    monkeypatch.delenv("GDSKV_CAPACTIY")
    monkeypatch.setenv("GDSKV_CAPACITY", "64k")
    _, err = _run(capsys, SMALL + ["--size=1M"], status=2)
    assert "GDSKV_CAPACITY=64k is less than the job's 32 pages take (1152KiB)" in err  # 32 KiB pages in 36 KiB slots (trailer)


def test_normal_report_says_where_it_wrote(tmp_path, capsys, no_gdskv_env):
    out, _ = _run(capsys, SMALL + ["--size=1M", "--rw=write", f"--directory={tmp_path}"])
    (line,) = [x for x in out.splitlines() if x.startswith("  store: ")]
    fs = cache.fs_type(str(tmp_path))
    (store,) = os.listdir(tmp_path)
    assert f"kept in {tmp_path / store} ({fs}; made under the directory from command line)" \
        in line
    assert "capacity=" in line and "(sized to the job)" in line
    assert "4 slab files per directory, preallocated=yes" in line


@pytest.fixture
def fake_drop_caches(tmp_path, monkeypatch):
    """Stand-in for /proc/sys/vm/drop_caches, and root, so the test can see a write to it."""
    path = tmp_path / "drop_caches"
    path.write_text("")
    monkeypatch.setattr(cache, "DROP_CACHES", str(path))
    monkeypatch.setattr(cache.os, "geteuid", lambda: 0)
    return path


def test_invalidate_drops_only_the_jobs_own_files(tmp_path, capsys, fake_drop_caches,
                                                  no_gdskv_env):
    d = tmp_path / "store"
    d.mkdir()
    inv = _job(capsys, SMALL + ["--size=1M", "--rw=write", "--verify=1", "--direct=0",
                                f"--directory={d}"])["gdskv"]["invalidate"]
    assert fake_drop_caches.read_text() == ""  # the machine's page cache was left alone
    assert inv["drop_caches"] is False and inv["fadvise_files"] == inv["files"] >= 1
    assert inv["drop_caches_status"].startswith("not asked")


def test_machine_wide_drop_only_when_asked(tmp_path, capsys, fake_drop_caches, no_gdskv_env):
    d = tmp_path / "store"
    d.mkdir()
    inv = _job(capsys, SMALL + ["--size=1M", "--rw=write", "--verify=1", "--drop_caches",
                                f"--directory={d}"])["gdskv"]["invalidate"]
    assert fake_drop_caches.read_text() == "1\n" and inv["drop_caches"] is True


@pytest.mark.skipif(cuda_available(), reason="needs a machine without a usable CUDA device")
@pytest.mark.parametrize("how", ["option", "environment"])
def test_kvikio_without_cuda_fails_up_front_in_one_line(tmp_path, capsys, monkeypatch, how,
                                                       no_gdskv_env):
    argv = SMALL + ["--size=1M", f"--directory={tmp_path}"]
    if how == "option":
        argv.append("--backend=kvikio")
    else:
        monkeypatch.setenv("GDSKV_BACKEND", "kvikio")
    out, err = _run(capsys, argv, status=2)
    assert out == "" and os.listdir(tmp_path) == []
    (line,) = err.splitlines()
    where = "option backend=kvikio" if how == "option" else "GDSKV_BACKEND=kvikio"
    assert line.startswith("gdskv-bench: error: ") and where in line and "CUDA device" in line


class _StatVfs:
    def __init__(self, real, **changes) -> None:
        self._real, self._changes = real, changes

    def __getattr__(self, name):
        return self._changes.get(name, getattr(self._real, name))


@pytest.mark.parametrize("changes, needle", [
    ({"f_flag": os.ST_RDONLY}, "is on a read-only file system"),
    ({"f_bavail": 0}, "has 0B free; the job's store needs 16380KiB there"),
])
def test_read_only_or_full_directory_is_one_error_line(tmp_path, capsys, monkeypatch, changes,
                                                       needle, no_gdskv_env):
    """No read-only or full file system can be mounted here, so statvfs reports one."""
    real = os.statvfs
    monkeypatch.setattr(placement.os, "statvfs", lambda p: _StatVfs(real(p), **changes))
    out, err = _run(capsys, SMALL + ["--size=1M", f"--directory={tmp_path}"], status=2)
    (line,) = err.splitlines()
    assert out == "" and needle in line and f"directory {str(tmp_path)!r}" in line
    assert os.listdir(tmp_path) == []


def test_missing_directory_names_where_it_came_from(tmp_path, capsys, monkeypatch,
                                                    no_gdskv_env):
    monkeypatch.setenv("GDSKV_DIRECTORIES", str(tmp_path / "not-mounted"))
    _, err = _run(capsys, SMALL + ["--size=1M"], status=2)
    assert "not-mounted" in err and "(from GDSKV_DIRECTORIES) is not a directory" in err
