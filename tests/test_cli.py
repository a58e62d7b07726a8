"""The ``gdskv`` command: each subcommand, its --json, bad input (one error line, exit 2,
nothing changed), and the lock rules beside a writer running in another process."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time

import pytest

from gdskv import cli
from gdskv.store import JOURNAL, LOCK, MANIFEST, MANIFEST_COPY
from gdskv.tier import Tier
from reliability_helpers import (LAYOUT, PAGE, check_pages, forkserver, hold_store, put,
                                 ready_keys, slot_location, small_config, spill_loop)

KEYS = [f"k{i}" for i in range(20)]


@pytest.fixture
def store(tmp_path):
    d = tmp_path / "store"
    d.mkdir(mode=0o700)
    with Tier(LAYOUT, small_config(d), device="cpu") as tier:
        assert all(put(tier, KEYS))
    return d


def gdskv(capsys, *argv) -> tuple[int, dict | str, str]:
    """Run the command in-process: (exit status, parsed --json output or text, stderr)."""
    try:
        status = cli.main([str(a) for a in argv])
    except SystemExit as exc:
        status = exc.code
    out, err = capsys.readouterr()
    return status, json.loads(out) if "--json" in argv and out else out, err


def _tree(path) -> dict:
    return {p.name: (p.stat().st_size, p.stat().st_mtime_ns) for p in sorted(path.iterdir())}


def test_info(store, capsys):
    status, out, _ = gdskv(capsys, "info", store, "--json")
    assert status == 0
    assert out["pages"] == 20 and out["bytes"] == 20 * PAGE and out["capacity_pages"] == 64
    assert out["fingerprint"] == LAYOUT.fingerprint and out["format_version"] == 2
    assert [os.path.basename(f["path"]) for f in out["slab_files"]] == ["slab-000.bin",
                                                                        "slab-001.bin"]
    assert out["journal_bytes"] == os.path.getsize(store / JOURNAL) and out["writer_pid"] is None
    status, text, _ = gdskv(capsys, "info", store)
    assert status == 0 and f"pages:       20 stored ({20 * PAGE // 1024} KiB) of 64 slots" in text
    # lines a person reads: no Python reprs (a dict, None, True) as info once printed
    assert not re.search(r"[{}]|\bNone\b|\bTrue\b|\bFalse\b", text), text
    assert f"layout:      model_name={LAYOUT.model_name}, " in text and ", mla=no" in text
    assert "writer:      no process on this host holds the store's lock" in text
    assert f"store:       {store}\n" in text and f"  {store / 'slab-000.bin'}  " in text


def test_ls(store, capsys):
    status, out, _ = gdskv(capsys, "ls", store, "--limit", 5, "--json")
    assert status == 0 and out["pages"] == 20
    assert [p["key"] for p in out["shown"]] == KEYS[:5]
    status, out, _ = gdskv(capsys, "ls", store, "--json")
    assert len(out["shown"]) == 20


def test_verify_finds_and_repairs_bad_pages(store, capsys):
    status, text, _ = gdskv(capsys, "verify", store)
    assert status == 0 and text == "checked 20 pages: all good\n"  # no empty "bad:" line
    with Tier(LAYOUT, small_config(store), device="cpu") as tier:
        where = {k: slot_location(tier, k) for k in ("k3", "k11")}
    for path, off in where.values():
        with open(path, "r+b") as f:
            f.seek(off + 100)
            b = f.read(1)
            f.seek(off + 100)
            f.write(bytes([b[0] ^ 1]))
    status, out, _ = gdskv(capsys, "verify", store, "--json")
    assert status == 1 and out["checked"] == 20
    assert sorted(b["key"] for b in out["bad"]) == ["k11", "k3"]
    assert {b["why"] for b in out["bad"]} == {"checksum mismatch"} and out["dropped"] == 0
    status, text, _ = gdskv(capsys, "verify", store)
    lines = text.splitlines()
    assert status == 1 and lines[0] == "checked 20 pages: 2 bad"
    assert sorted(x.split(",")[0] for x in lines[1:3]) == ["  key=k11", "  key=k3"]
    assert all(x.endswith(": checksum mismatch") for x in lines[1:3])
    assert lines[3:] == ["gdskv verify --repair drops them"]
    status, out, _ = gdskv(capsys, "verify", store, "--sample", 5, "--json")
    assert out["checked"] == 5 and status == (1 if out["bad"] else 0)
    status, out, _ = gdskv(capsys, "verify", store, "--repair", "--json")
    assert status == 1 and out["dropped"] == 2
    status, out, _ = gdskv(capsys, "verify", store, "--json")
    assert status == 0 and out["checked"] == 18 and not out["bad"]


def test_rebuild_after_the_journal_is_lost(store, capsys):
    os.unlink(store / JOURNAL)
    status, out, _ = gdskv(capsys, "rebuild", store, "--json")
    assert status == 0 and out["pages"] == 20 and out["from_trailers"] == 20
    with Tier(LAYOUT, small_config(store), device="cpu") as tier:
        assert set(ready_keys(tier)) == set(KEYS)
        assert not check_pages(tier, KEYS)["missed"]


def test_compact(store, capsys):
    with Tier(LAYOUT, small_config(store), device="cpu") as tier:
        tier.evict(KEYS[:10])
    before = os.path.getsize(store / JOURNAL)
    status, out, _ = gdskv(capsys, "compact", store, "--json")
    assert status == 0 and out["pages"] == 10 and out["journal_bytes_before"] == before
    assert out["journal_bytes_after"] < before
    with Tier(LAYOUT, small_config(store), device="cpu") as tier:
        assert set(ready_keys(tier)) == set(KEYS[10:])


def test_clear_asks_unless_yes(store, capsys, monkeypatch):
    before = _tree(store)
    status, _, err = gdskv(capsys, "clear", store)  # stdin is not a terminal under pytest
    assert status == 2 and "pass --yes" in err and _tree(store) == before
    monkeypatch.setattr(sys.stdin, "isatty", lambda: True)
    monkeypatch.setattr("builtins.input", lambda prompt: "no")
    status, _, err = gdskv(capsys, "clear", store)
    assert status == 2 and "not confirmed" in err and _tree(store) == before
    status, out, _ = gdskv(capsys, "clear", store, "--yes", "--json")
    assert status == 0 and out["dropped"] == 20
    with Tier(LAYOUT, small_config(store), device="cpu") as tier:
        assert len(tier.directory) == 0


@pytest.mark.parametrize("command", ["info", "ls", "verify", "rebuild", "compact", "clear"])
def test_bad_input_is_one_error_and_changes_nothing(tmp_path, store, capsys, command):
    extra = ["--yes"] if command == "clear" else []
    afile = tmp_path / "afile"
    afile.write_text("x")
    empty = tmp_path / "empty"
    empty.mkdir()
    for target, says in ((tmp_path / "missing", "does not exist"), (afile, "not a directory"),
                         (empty, "no gdskv store")):
        status, _, err = gdskv(capsys, command, target, *extra)
        assert status == 2 and err.count("gdskv: error:") == 1 and says in err, err
    assert list(empty.iterdir()) == []  # nothing created
    # a store of the older format: refused with the reason, nothing changed
    for name in (MANIFEST, MANIFEST_COPY):
        m = json.loads((store / name).read_text())
        m.update(format_version=1)
        (store / name).write_text(json.dumps(m))
    before = _tree(store)
    status, _, err = gdskv(capsys, command, store, *extra)
    assert status == 2 and "format version 1" in err and _tree(store) == before


@pytest.mark.parametrize("argv, says", [(["ls", "--limit", "-1"], "-1 is below 0"),
                                        (["verify", "--sample", "x"], "'x' is not a whole number")])
def test_bad_option_values(store, capsys, argv, says):
    before = _tree(store)
    status, _, err = gdskv(capsys, *argv, store)
    assert status == 2 and says in err and _tree(store) == before


def test_version(capsys):
    with pytest.raises(SystemExit) as exc:
        cli.main(["--version"])
    assert exc.value.code == 0 and capsys.readouterr().out.startswith("gdskv ")
    out = subprocess.run([os.path.join(os.path.dirname(sys.executable), "gdskv-bench"),
                          "--version"], capture_output=True, text=True)
    assert out.returncode == 0 and out.stdout.startswith("gdskv-bench ")


def test_beside_a_running_writer(tmp_path, capsys):
    """info, ls and verify run beside a writer in another process (it puts and evicts all the
    while): verify reports no bad page for the writer's own changes. The others refuse the
    held store: exit 2, nothing changed."""
    store = tmp_path / "store"
    store.mkdir(mode=0o700)
    ctx = forkserver()
    child = ctx.Process(target=spill_loop, args=(str(store), str(tmp_path / "log"), 7, 200, {}))
    child.start()
    try:
        t0 = time.monotonic()
        while not (store / JOURNAL).exists() or os.path.getsize(store / JOURNAL) < 2000:
            assert child.is_alive() and time.monotonic() - t0 < 60
            time.sleep(0.05)
        for _ in range(3):
            status, out, _ = gdskv(capsys, "info", store, "--json")
            assert status == 0 and out["writer_pid"] == child.pid and out["pages"] > 0
            status, out, _ = gdskv(capsys, "ls", store, "--json")
            assert status == 0 and out["pages"] > 0
            status, out, _ = gdskv(capsys, "verify", store, "--json")
            assert status == 0 and not out["bad"], out
        for command in (["rebuild"], ["compact"], ["clear", "--yes"], ["verify", "--repair"]):
            status, _, err = gdskv(capsys, *command[:1], store, *command[1:])
            assert status == 2 and "open in another process" in err, (command, err)
    finally:
        child.kill()
        child.join()


def test_commands_that_take_the_lock_refuse_a_writer_whose_lock_file_was_removed(tmp_path,
                                                                                  capsys):
    """gdskv.lock removed under a running writer (issue 46, item 3): rebuild, compact, clear,
    verify --repair and cluster reclaim still see the writer (it holds its slab files' locks)
    and refuse, changing nothing."""
    root = tmp_path / "cluster"
    store = root / "node0"  # a plain store is a cluster namespace, as a node's writer makes it
    store.mkdir(parents=True, mode=0o700)
    ctx = forkserver()
    ready = tmp_path / "ready"
    child = ctx.Process(target=hold_store, args=(str(store), str(ready), {}))
    child.start()
    try:
        t0 = time.monotonic()
        while not ready.exists():
            assert child.is_alive() and time.monotonic() - t0 < 60
            time.sleep(0.05)
        os.unlink(store / LOCK)
        before = _tree(store)
        for command in (["rebuild"], ["compact"], ["clear", "--yes"], ["verify", "--repair"]):
            status, _, err = gdskv(capsys, *command[:1], store, *command[1:])
            assert status == 2 and "open in another process" in err, (command, err)
        status, _, err = gdskv(capsys, "cluster", "reclaim", "node0", root, "--yes")
        assert status == 2 and "in use" in err, err
        assert _tree(store) == before
    finally:
        child.kill()
        child.join()
    with Tier(LAYOUT, small_config(store), device="cpu") as tier:
        assert check_pages(tier, ["held"])["hits"] == 1
