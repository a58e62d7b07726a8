"""Copied, moved and restored stores (issue 48, item 2; issue 46, item 6; docs/backup.md).

A copy (``cp -a``, rsync, a restored volume) gives every slab file a new inode. Its pages are
kept where the slot trailer names this store and agrees with the journal (or is newer than
anything the journal knows of that key); a slab brought back from an older copy never serves a
key's older version."""

from __future__ import annotations

import json
import os
import shutil
import subprocess

import pytest
import torch

from gdskv import cli
from gdskv.store import JOURNAL
from gdskv.tier import Tier
from reliability_helpers import (LAYOUT, PAGE, SLOT, check_pages, page_content, put,
                                 ready_keys, small_config)

CAPACITY = 256 * SLOT
SLABS = ("slab-000.bin", "slab-001.bin")


def _cp_a(src, dst) -> None:
    subprocess.run(["cp", "-a", str(src), str(dst)], check=True)


def _copy_renamed(src, dst) -> None:
    """What rsync does: each file written beside its place, then renamed over it."""
    os.makedirs(dst, mode=0o700, exist_ok=True)
    for name in os.listdir(src):
        shutil.copy2(os.path.join(src, name), os.path.join(dst, name + ".part"))
        os.replace(os.path.join(dst, name + ".part"), os.path.join(dst, name))


@pytest.mark.parametrize("how", ["cp -a", "rsync-like"])
def test_a_copied_store_keeps_its_pages(tmp_path, how, capsys):
    src, dst = tmp_path / "src", tmp_path / "dst"
    src.mkdir(mode=0o700)
    keys = [f"c{i}" for i in range(128)]
    with Tier(LAYOUT, small_config(src, capacity=CAPACITY), device="cpu") as tier:
        assert all(put(tier, keys))
    (_cp_a if how == "cp -a" else _copy_renamed)(src, dst)
    assert all(os.stat(src / n).st_ino != os.stat(dst / n).st_ino for n in SLABS)
    # a read-only look first (gdskv info), then the writer
    assert cli.main(["info", str(dst), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["pages"] == 128
    with Tier(LAYOUT, small_config(dst, capacity=CAPACITY), device="cpu") as tier:
        res = check_pages(tier, keys)
        print(f"{how}: {res['hits']} of 128 pages kept")
        assert res["hits"] == 128 and not res["wrong"]
        assert tier.store.replaced_files == {0, 1}
        assert all(put(tier, ["new"]))
    with Tier(LAYOUT, small_config(dst, capacity=CAPACITY), device="cpu") as tier:
        assert tier.store.replaced_files == set()  # the copy's identity is recorded now
        assert check_pages(tier, keys + ["new"])["hits"] == 129


def _served(tier, key, versions) -> str | None:
    out = torch.zeros(PAGE, dtype=torch.uint8)
    if not tier.get_pages([key], [[out]])[0]:
        return None
    return next(v for v in versions if torch.equal(out, page_content(f"{key}@{v}")))


def _put_versions(tier, keys, version) -> None:
    assert all(tier.put_pages(keys, [[page_content(f"{k}@{version}")] for k in keys]))


@pytest.mark.parametrize("restore", ["in place", "new inode"])
def test_a_slab_restored_from_an_older_copy_serves_no_older_version(tmp_path, restore, capsys):
    """K0..K15 v1 are backed up; then K0..K7 get a v2 (in the same slots) and K0..K3 are
    evicted. slab-000.bin restored from the backup brings v1 of K0..K3 back onto the disk: no
    open, and no rebuild, may serve them; the pages the backup and the store agree on stay."""
    store, backup = tmp_path / "store", tmp_path / "backup"
    store.mkdir(mode=0o700)
    cfg = small_config(store, capacity=CAPACITY)
    keys = [f"K{i}" for i in range(16)]
    with Tier(LAYOUT, cfg, device="cpu") as tier:
        _put_versions(tier, keys, "v1")
    _cp_a(store, backup)
    with Tier(LAYOUT, cfg, device="cpu") as tier:
        tier.evict(keys[:8])
        _put_versions(tier, keys[:8], "v2")
        tier.evict(keys[:4])
    slab = store / SLABS[0]
    if restore == "in place":  # cp over an existing file writes into it: same inode
        shutil.copyfile(backup / SLABS[0], slab)
    else:
        shutil.copy2(backup / SLABS[0], str(slab) + ".part")
        os.replace(str(slab) + ".part", slab)
    older = {}
    for step in ("open", "rebuild"):
        if step == "rebuild":
            assert cli.main(["rebuild", str(store), "--json"]) == 0
            capsys.readouterr()
        with Tier(LAYOUT, cfg, device="cpu") as tier:
            served = {k: _served(tier, k, ["v1", "v2"]) for k in keys}
        older[step] = sorted(k for k in keys[:8] if served[k] == "v1")
        assert all(served[k] in (None, "v2") for k in keys[4:8])
        assert all(served[k] == "v1" for k in keys[8:]), served  # agreed on: kept
    print(f"restore {restore}: older versions served {older}")
    assert not older["open"] and not older["rebuild"], older


def test_a_store_moved_whole_keeps_its_pages_without_a_scan(tmp_path):
    """A rename keeps the inodes: nothing to check, no scan."""
    src = tmp_path / "src"
    src.mkdir(mode=0o700)
    with Tier(LAYOUT, small_config(src), device="cpu") as tier:
        assert all(put(tier, ["a", "b"]))
    os.rename(src, tmp_path / "moved")
    with Tier(LAYOUT, small_config(tmp_path / "moved"), device="cpu") as tier:
        assert set(ready_keys(tier)) == {"a", "b"} and "header_scan_pages" not in tier.stats()
    assert os.path.exists(tmp_path / "moved" / JOURNAL)
