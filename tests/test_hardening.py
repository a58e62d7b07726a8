"""Issue 19: the defects an adversarial campaign found, and one clear error for every bad input.

Each test drives the real store, files and processes; a bad input must give one error naming the
option, the value and what to do, and leave the disk as it was. (ENOSPC at creation and a failed
creation's cleanup: tests/test_resources.py; the SGLang adapter's inputs:
tests/test_sglang_adapter.py.)
"""

from __future__ import annotations

import ctypes
import dataclasses
import logging
import os
import shutil

import pytest
import torch

from gdskv.config import ConfigError, TierConfig
from gdskv.layout import KVLayout
from gdskv.store import MANIFEST, MANIFEST_COPY, StoreError, StoreMismatchError
from gdskv.tier import Tier, TierClosedError
from reliability_helpers import (LAYOUT, SLOT, check_pages, page_content, put, read_back,
                                 slot_location, small_config)


def _fd_count() -> int:
    return len(os.listdir("/proc/self/fd"))


def _tree(path) -> dict:
    """Every file below ``path`` with its size: 'nothing changed on disk' is this, equal."""
    out = {}
    for dirpath, _, files in os.walk(path):
        for name in files:
            full = os.path.join(dirpath, name)
            out[os.path.relpath(full, path)] = os.path.getsize(full)
    return out


# -- defect 1: a store without its manifest -------------------------------------------------------
@pytest.mark.parametrize("other", [{"dtype": "fp16"}, {"model_name": "another"}, {}],
                         ids=["other-dtype", "other-model", "same-layout"])
def test_store_without_manifest_is_refused_not_adopted(tmp_path, other):
    layout = dataclasses.replace(LAYOUT, model_name="m", dtype="bf16")
    with Tier(layout, small_config(tmp_path), device="cpu") as tier:
        assert all(put(tier, ["a", "b", "c"]))
    os.unlink(tmp_path / MANIFEST)
    os.unlink(tmp_path / MANIFEST_COPY)
    before = _tree(tmp_path)
    with pytest.raises(StoreMismatchError, match=r"store files without a manifest .*"
                       r"gdskv-journal\.log.*slab-000\.bin.*remove these files") as info:
        Tier(dataclasses.replace(layout, **other), small_config(tmp_path), device="cpu")
    assert MANIFEST in str(info.value)
    assert _tree(tmp_path) == before  # the journal was not replayed, nothing was rewritten


# -- defect 6: a manifest that is JSON but not an object ------------------------------------------
@pytest.mark.parametrize("text", ["[]", "null", "3", '"x"'])
def test_manifest_that_is_not_an_object(tmp_path, text):
    with Tier(LAYOUT, small_config(tmp_path), device="cpu") as tier:
        assert all(put(tier, ["a"]))
    (tmp_path / MANIFEST).write_text(text)
    (tmp_path / MANIFEST_COPY).write_text(text)
    with pytest.raises(StoreMismatchError, match="unreadable store manifest .*not an object"
                       ".*its copy is damaged too"):
        Tier(LAYOUT, small_config(tmp_path), device="cpu")


@pytest.mark.parametrize("damage", ["deleted", "bit-flipped", "not-json"])
def test_damaged_manifest_is_restored_from_its_copy(tmp_path, damage, caplog):
    """One warning naming the damage and the copy; the manifest is written back; every page is
    still served."""
    with Tier(LAYOUT, small_config(tmp_path), device="cpu") as tier:
        assert all(put(tier, ["a", "b"]))
    path = tmp_path / MANIFEST
    good = path.read_bytes()
    if damage == "deleted":
        path.unlink()
    elif damage == "bit-flipped":
        raw = bytearray(good)
        raw[raw.index(b'"num_slots": ') + 13] ^= 1  # still JSON, another number
        path.write_bytes(bytes(raw))
    else:
        path.write_text("{")
    with caplog.at_level("WARNING", logger="gdskv.store"):
        with Tier(LAYOUT, small_config(tmp_path), device="cpu") as tier:
            res = check_pages(tier, ["a", "b"])
            assert res["hits"] == 2 and not res["wrong"]
    lines = [r.getMessage() for r in caplog.records if MANIFEST_COPY in r.getMessage()]
    assert len(lines) == 1 and "restoring the manifest" in lines[0], lines
    assert path.read_bytes() == good


# -- defect 3: a failed Tier() releases the lock and its descriptors ------------------------------
def test_failed_constructor_releases_lock_and_fds(tmp_path, monkeypatch):
    cfg = small_config(tmp_path)
    Tier(LAYOUT, cfg, device="cpu").close()  # the store exists: later opens only open it
    import gdskv.tier as tier_mod

    class NoThreads:
        def __init__(self, *a, **k):
            raise RuntimeError("can't start new thread")

    fds = _fd_count()
    with monkeypatch.context() as m:
        m.setattr(tier_mod, "ThreadPoolExecutor", NoThreads)  # the last step of __init__ fails
        for _ in range(3):
            with pytest.raises(RuntimeError, match="can't start new thread"):
                Tier(LAYOUT, cfg, device="cpu")
    assert _fd_count() == fds  # nothing leaked per attempt
    with Tier(LAYOUT, cfg, device="cpu") as tier:  # the lock was released: no StoreLockedError
        assert all(put(tier, ["after"]))


# -- defect 4: booleans given as strings, and every field's type ----------------------------------
@pytest.mark.parametrize("text, value", [("false", False), ("False", False), ("0", False),
                                         ("no", False), ("OFF", False), ("true", True),
                                         ("Yes", True), ("1", True), ("on", True),
                                         (0, False), (1, True)])
def test_booleans_parse_the_same_from_python_json_and_env(text, value):
    for field in ("read_only", "verify", "preallocate"):
        if field == "read_only" and value:
            continue  # a follower needs verify (checked elsewhere)
        assert getattr(TierConfig(**{field: text}), field) is value
        if isinstance(text, str):
            env = {"GDSKV_" + field.upper(): text}
            assert getattr(TierConfig.from_env(env), field) is value


@pytest.mark.parametrize("kwargs, match", [
    ({"read_only": "maybe"}, r"read_only: expected a boolean .* got 'maybe'"),
    ({"verify": 2}, r"verify: expected a boolean .* got 2"),
    ({"preallocate": None}, r"preallocate: expected a boolean .* got None"),
    ({"directories": 5}, r"directories: expected a list of directory paths .* got 5"),
    ({"directories": None}, r"directories: expected a list of directory paths .* got None"),
    ({"directories": ["/a", 3]}, r"directories: expected a list of directory paths"),
    ({"io_threads": "eight"}, r"io_threads: expected an integer, got 'eight'"),
    ({"io_threads": 8.5}, r"io_threads: expected an integer, got 8.5"),
    ({"pipeline_depth": True}, r"pipeline_depth: expected an integer, got True"),
    ({"backend": 3}, r"backend: 3 is not one of auto, posix, kvikio, nixl"),
    ({"nixl_posix_queue": 1}, r"nixl_posix_queue: expected a string, got 1"),
])
def test_every_field_type_is_checked_in_one_place(kwargs, match):
    with pytest.raises(ConfigError, match=match):
        TierConfig(**kwargs)


# -- defect 5: a short read fails only the pages it did not read ----------------------------------
@pytest.mark.parametrize("verify", [True, False])
@pytest.mark.parametrize("aligned", [False, True], ids=["staged", "in-place"])
def test_short_read_keeps_the_pages_read_whole(tmp_path, verify, aligned):
    # one file, 16-slot stripes, 8-page staging parts: the 8 pages are one extent, one read
    cfg = small_config(tmp_path, files_per_dir=1, io_chunk_size=16 * SLOT,
                       staging_size=32 * SLOT, verify=verify)
    keys = [f"s{i}" for i in range(8)]
    with Tier(LAYOUT, cfg, device="cpu") as tier:
        assert all(put(tier, keys, aligned=aligned))
        path, off = slot_location(tier, keys[6])
        assert [slot_location(tier, k) for k in keys] == [(path, i * SLOT) for i in range(8)]
        os.truncate(path, off + 100)  # the slab ends in the middle of page 6
        hits, out = read_back(tier, keys, aligned=aligned)
        assert hits == [True] * 6 + [False] * 2
        for k, h, o in zip(keys, hits, out):
            assert not h or torch.equal(o, page_content(k))
        # the 2 pages past the end are dropped (issue 46 #1): misses without another read
        assert [tier.contains(k) for k in keys] == hits
        one_by_one = [read_back(tier, [k], aligned=aligned)[0][0] for k in keys]
        assert one_by_one == hits
        # unaligned regions go in place too where no slab file has O_DIRECT
        in_place = aligned or not any(f.direct for f in tier.store.files)
        assert tier.stats().get("pages_read_in_place", 0) == (8 + 6 if in_place else 0)


# -- files removed under a running writer ---------------------------------------------------------
@pytest.mark.parametrize("victim", ["slab-000.bin", "gdskv-journal.log", "gdskv.lock"])
def test_files_removed_under_a_writer_stop_puts(tmp_path, victim, caplog):
    cfg = small_config(tmp_path)
    with Tier(LAYOUT, cfg, device="cpu") as tier:
        assert all(put(tier, [f"a{i}" for i in range(8)]))
        os.unlink(tmp_path / victim)
        with caplog.at_level(logging.ERROR, logger="gdskv.tier"):
            assert put(tier, [f"b{i}" for i in range(8)]) == [False] * 8
            assert put(tier, ["c"]) == [False]  # from now on, nothing is acknowledged
        errors = [r for r in caplog.records if "removed while open" in r.getMessage()]
        assert len(errors) == 1 and victim in errors[0].getMessage()
        s = tier.stats()
        assert s["store_files_removed"] == 1 and s["state"].startswith("puts refused: store "
                                                                       "files removed")
        assert s["put_refused"] == 1
        assert check_pages(tier, [f"a{i}" for i in range(8)])["wrong"] == []


# -- one clear error for every bad input ----------------------------------------------------------
@pytest.mark.parametrize("var, value, match", [
    ("GDSKV_CAPACITY", "99999999999999999999", r"GDSKV_CAPACITY=.*larger than this platform"),
    ("GDSKV_STAGING_SIZE", "99999999999999999999P", r"GDSKV_STAGING_SIZE=.*larger than"),
    ("GDSKV_DIRECTORIES", "/tmp/a\0b", r"GDSKV_DIRECTORIES=.*NUL byte"),
    ("GDSKV_READ_ONLY", "nope", r"GDSKV_READ_ONLY='nope': read_only: expected a boolean"),
])
def test_env_values_out_of_range_name_the_variable(var, value, match):
    with pytest.raises(ConfigError, match=match):
        TierConfig.from_env({var: value})


def test_staging_larger_than_memory_is_refused_before_the_store(tmp_path):
    with pytest.raises(ConfigError, match=r"staging_size: a staging buffer of \d+ B does not "
                       r"fit \(\d+ B of host memory available\); lower staging_size"):
        Tier(LAYOUT, small_config(tmp_path, staging_size="1T"), device="cpu")
    assert os.listdir(tmp_path) == []


def test_directory_that_cannot_fit_in_memory_is_refused(tmp_path):
    with pytest.raises(ConfigError, match=r"capacity \d+ B is \d+ slots of 4096 B; their page "
                       r"directory needs about \d+ B of host memory"):
        Tier(LAYOUT, small_config(tmp_path, capacity="1P", preallocate=False,
                                  io_chunk_size="16MiB"), device="cpu")
    assert os.listdir(tmp_path) == []  # not even the lock file


def test_same_directory_twice(tmp_path):
    d = tmp_path / "store"
    d.mkdir(mode=0o700)
    (tmp_path / "link").symlink_to(d)
    for dirs in ((str(d), str(d)), (str(d), str(tmp_path / "link"))):
        with pytest.raises(ConfigError, match="are the same directory .*list each store "
                           "directory once"):
            Tier(LAYOUT, small_config(d).replace(directories=dirs), device="cpu")
    assert os.listdir(d) == []


def test_same_directory_through_a_bind_mount(tmp_path):
    import subprocess
    d, alias = tmp_path / "store", tmp_path / "alias"
    d.mkdir(mode=0o700)
    alias.mkdir(mode=0o700)
    proc = subprocess.run(["mount", "--bind", str(d), str(alias)], capture_output=True, text=True)
    if proc.returncode:
        pytest.skip(f"cannot bind-mount here: {proc.stderr.strip()}")
    try:
        with pytest.raises(ConfigError, match="are the same directory"):
            Tier(LAYOUT, small_config(d).replace(directories=(str(d), str(alias))),
                 device="cpu")
    finally:
        subprocess.run(["umount", "-l", str(alias)], check=False)


def test_enospc_while_rewriting_the_manifest(small_fs):
    """Reopening after a slab file was replaced rewrites the manifest; on a full disk that is one
    StoreError naming the manifest, no .tmp left, the old manifest unchanged."""
    cfg = small_config(small_fs, capacity=32 * SLOT)
    Tier(LAYOUT, cfg, device="cpu").close()
    slab = small_fs / "slab-000.bin"
    shutil.copyfile(slab, small_fs / "copy")
    os.replace(small_fs / "copy", slab)  # a new inode: the manifest must record it
    manifest = (small_fs / MANIFEST).read_bytes()
    st = os.statvfs(small_fs)
    with open(small_fs / "filler", "wb") as fh:
        os.posix_fallocate(fh.fileno(), 0, st.f_bavail * st.f_frsize)
    with pytest.raises(StoreError, match=r"cannot write the store manifest .*gdskv-manifest\.json"
                       r": No space left on device; the previous manifest .* is unchanged"):
        Tier(LAYOUT, cfg, device="cpu")
    assert not (small_fs / (MANIFEST + ".tmp")).exists()
    assert (small_fs / MANIFEST).read_bytes() == manifest
    os.unlink(small_fs / "filler")
    with Tier(LAYOUT, cfg, device="cpu") as tier:  # space back: it opens
        assert all(put(tier, ["ok"]))


def _cuda_driver() -> bool:
    try:
        ctypes.CDLL("libcuda.so.1")
    except OSError:
        return False
    return True


@pytest.mark.skipif(_cuda_driver(), reason="this host has the CUDA driver: kvikio can run")
def test_kvikio_without_a_cuda_driver_is_refused_at_open(tmp_path):
    pytest.importorskip("kvikio", reason="kvikio (the gpu extra) is not installed")
    with pytest.raises(ConfigError, match=r"backend 'kvikio' cannot do I/O on this host: kvikio "
                       r"needs the CUDA driver \(libcuda.so.1\).*use backend=posix"):
        Tier(LAYOUT, small_config(tmp_path, backend="kvikio"), device="cpu")
    assert os.listdir(tmp_path) == []  # refused before the store was opened
    with Tier(LAYOUT, small_config(tmp_path), device="cpu") as tier:
        assert all(put(tier, ["a"]))  # the refused open left the store usable


def test_every_call_on_a_closed_tier_raises(tmp_path, caplog):
    tier = Tier(LAYOUT, small_config(tmp_path), device="cpu")
    assert all(put(tier, ["a"]))
    tier.close()
    pool = (torch.zeros(LAYOUT.num_layers, 8, 1, 48, dtype=torch.bfloat16),) * 2
    calls = {
        "put": lambda: tier.put(["x"], pool, torch.arange(4)),
        "get": lambda: tier.get(["a"], pool, torch.arange(4)),
        "put_async": lambda: tier.put_async(["x"], pool, torch.arange(4)),
        "get_async": lambda: tier.get_async(["a"], pool, torch.arange(4)),
        "put_pages": lambda: put(tier, ["x"]),
        "get_pages": lambda: read_back(tier, ["a"]),
        "contains": lambda: tier.contains("a"),
        "match_prefix": lambda: tier.match_prefix(["a"]),
        "evict": lambda: tier.evict(["a"]),
        "clear": tier.clear,
        "refresh": tier.refresh,
    }
    with caplog.at_level(logging.WARNING):
        for name, call in calls.items():
            with pytest.raises(TierClosedError, match="tier is closed"):
                call()
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR]
    tier.close()  # closing again is fine
    assert tier.stats()["state"] == "closed"  # the final counters stay readable


def test_put_pages_from_a_meta_region_is_refused_up_front(tmp_path):
    with Tier(LAYOUT, small_config(tmp_path), device="cpu") as tier:
        meta = torch.empty(LAYOUT.page_bytes, dtype=torch.uint8, device="meta")
        with pytest.raises(ValueError, match=r"page 0: a region is on meta; regions must be in "
                           r"host memory or on the tier's device"):
            tier.put_pages(["m"], [[meta]])
        expanded = torch.zeros(1, dtype=torch.uint8).expand(LAYOUT.page_bytes)
        assert all(put(tier, ["e"]))
        with pytest.raises(ValueError, match="page 0: regions must be contiguous"):
            tier.get_pages(["e"], [[expanded]])
        assert tier.stats().get("put_pages", 0) == 1  # nothing of the refused calls ran


@pytest.mark.parametrize("how", ["slots", "layers"])
def test_get_into_an_expanded_pool_is_refused_up_front(tmp_path, how):
    layout = KVLayout(num_layers=2, page_size=4, head_dim=16, kv_heads=2, dtype="fp16")
    cfg = TierConfig(directories=(str(tmp_path),), capacity="4MiB", staging_size="256KiB",
                     io_chunk_size="64KiB", backend="posix")
    with Tier(layout, cfg, device="cpu") as tier:
        pool = tuple(torch.randn(2, 16, 2, 16).half() for _ in range(2))
        assert tier.put(["k"], pool, torch.arange(4)) == [True]
        if how == "slots":
            row = torch.zeros(2, 1, 2, 16, dtype=torch.float16)
            bad = tuple(row.expand(2, 16, 2, 16) for _ in range(2))
            match = "token rows overlap"
        else:
            layer = torch.zeros(1, 16, 2, 16, dtype=torch.float16)
            bad = tuple(layer.expand(2, 16, 2, 16) for _ in range(2))
            match = "every layer is the same memory"
        with pytest.raises(ValueError, match=match):
            tier.get(["k"], bad, torch.arange(4))


def test_errors_doc_lists_every_error_class():
    """docs/errors.md names each error type a user can meet."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    with open(os.path.join(root, "docs", "errors.md"), encoding="utf-8") as fh:
        text = fh.read()
    for name in ("ConfigError", "StoreDirectoryError", "StoreError", "StoreMismatchError",
                 "StoreLockedError", "TierClosedError", "puts refused", "ShortIOError"):
        assert name in text, name


def test_creation_killed_before_its_manifest_is_made_again(tmp_path, monkeypatch, caplog):
    """A creation that dies after its slab files but before its manifest (SIGKILL: nothing
    cleans up) leaves gdskv-creating beside them: the next open removes them, says so once and
    creates the store; without the marker the files stay refused."""
    import gdskv.store as store_mod

    class Killed(BaseException):
        pass

    def die(self):
        raise Killed()

    monkeypatch.setattr(store_mod.SlabStore, "_check_identity", die)
    monkeypatch.setattr(store_mod.SlabStore, "_remove_created", lambda self: None)  # as SIGKILL
    with pytest.raises(Killed):
        Tier(LAYOUT, small_config(tmp_path), device="cpu")
    monkeypatch.undo()
    assert {"slab-000.bin", store_mod.CREATING} <= set(os.listdir(tmp_path))
    with caplog.at_level("WARNING", logger="gdskv.store"):
        with Tier(LAYOUT, small_config(tmp_path), device="cpu") as tier:
            assert all(put(tier, ["a"]))
    assert sum("interrupted" in r.getMessage() for r in caplog.records) == 1
    assert store_mod.CREATING not in os.listdir(tmp_path)
