"""Self-describing slots: the trailer format, and the header scan that rebuilds the directory
when the journal is gone or damaged (gdskv/slot_trailer.py, gdskv/header_scan.py)."""

from __future__ import annotations

import json
import os

import crc32c
import numpy as np
import pytest
import torch

from gdskv import slot_trailer
from gdskv.journal import decode_all, live_records
from gdskv.layout import FORMAT_VERSION
from gdskv.store import JOURNAL, MANIFEST, MANIFEST_COPY, StoreMismatchError
from gdskv.tier import Tier
from reliability_helpers import (LAYOUT, PAGE, SLOT, check_pages, page_content, put, ready_keys,
                                 slot_location, small_config)


def _journal_live(directory) -> dict:
    with open(os.path.join(directory, JOURNAL), "rb") as f:
        return live_records(decode_all(f.read()).records)


@pytest.mark.parametrize("key", ["k", "é" * 128, b"\x00\xff" * 128, "x" * 300])
def test_trailer_round_trip(key):
    raw = slot_trailer.encode(FORMAT_VERSION, 77, 5, key, 9, 1234, 1)
    assert len(raw) == slot_trailer.TRAILER_BYTES
    t = slot_trailer.decode(raw)
    assert (t.slot, t.seq, t.checksum, t.algorithm, t.store_id) == (5, 9, 1234, 1, 77)
    long_key = len(key.encode() if isinstance(key, str) else key) > slot_trailer.KEY_BYTES
    assert t.key == (None if long_key else key)  # too long: digest only, not adoptable
    for i in range(0, len(raw), 7):  # any damaged byte: no trailer
        bad = bytearray(raw)
        bad[i] ^= 0x40
        assert slot_trailer.decode(bytes(bad)) is None, i
    assert slot_trailer.decode(bytes(len(raw))) is None


@pytest.mark.parametrize("key", ["k", "é" * 128, b"\x00\xff" * 128, "x" * 300])
def test_sealing_a_zero_checksum_trailer_is_encoding_with_the_checksum(key):
    """What the GPU does to a spill's trailers (gdskv.gpu_spill): the checksum put into a
    trailer encoded with checksum 0, its crc32c corrected through the per-bit table."""
    rng = np.random.default_rng(5)
    zeroed = slot_trailer.encode(FORMAT_VERSION, 77, 5, key, 9, 0, 2)
    for csum in [0, 1, 1 << 63, (1 << 64) - 1, *rng.integers(0, 1 << 63, 20, dtype=np.int64)]:
        csum = int(csum)
        sealed = slot_trailer.seal(zeroed, csum)
        assert sealed == slot_trailer.encode(FORMAT_VERSION, 77, 5, key, 9, csum, 2)
        assert slot_trailer.decode(sealed).checksum == csum


@pytest.mark.parametrize("device", [
    "cpu", pytest.param("cuda", marks=[pytest.mark.gpu, pytest.mark.skipif(
        not torch.cuda.is_available(), reason="needs a CUDA device")])])
def test_trailer_is_written_with_the_page(tmp_path, device):
    """The trailer goes out in the page's own write, from host or GPU staging, and names the
    page as its journal COMMIT does (same seq, checksum and algorithm)."""
    with Tier(LAYOUT, small_config(tmp_path), device=device) as tier:
        assert all(tier.put_pages(["a", "b"], [[page_content(k).to(device)] for k in "ab"]))
        path, off = slot_location(tier, "b")
        store_id = tier.store.store_id
    commit = _journal_live(tmp_path)["b"]
    with open(path, "rb") as f:
        f.seek(off + SLOT - slot_trailer.TRAILER_BYTES)
        t = slot_trailer.decode(f.read(slot_trailer.TRAILER_BYTES))
    assert t.key == "b" and t.store_id == store_id and t.version == FORMAT_VERSION
    assert (t.seq, t.checksum, t.algorithm) == (commit.seq, commit.checksum, commit.algorithm)
    if device == "cuda":  # GPU staging: rebuilt from trailers, the pages read back exact
        os.unlink(tmp_path / JOURNAL)
        with Tier(LAYOUT, small_config(tmp_path), device=device) as tier:
            out = [torch.zeros(PAGE, dtype=torch.uint8, device=device) for _ in "ab"]
            assert tier.get_pages(["a", "b"], [[o] for o in out]) == [True, True]
            torch.cuda.synchronize()
            assert all(torch.equal(o.cpu(), page_content(k)) for k, o in zip("ab", out))


def test_deleted_journal_rebuilt_from_trailers(tmp_path, caplog):
    cfg = small_config(tmp_path)
    keys = [f"p{i}" for i in range(40)]
    with Tier(LAYOUT, cfg, device="cpu") as tier:
        assert all(put(tier, keys))
        tier.evict(keys[:5])
        assert all(put(tier, ["late"]))  # reuses a slot an evicted page left
    os.unlink(tmp_path / JOURNAL)
    with caplog.at_level("WARNING"):
        with Tier(LAYOUT, cfg, device="cpu") as tier:
            res = check_pages(tier, keys + ["late"])
            assert not res["wrong"]
            # evicted pages whose slots were not reused may come back (their own bytes)
            assert set(keys[5:]) | {"late"} <= set(ready_keys(tier))
            assert res["hits"] == len(ready_keys(tier))
            assert tier.stats()["header_scan_pages"] == len(ready_keys(tier))
            assert all(put(tier, ["after"]))
    assert sum("header scan" in r.getMessage() for r in caplog.records) == 1
    with Tier(LAYOUT, cfg, device="cpu") as tier:  # the journal was rewritten: fast path
        assert "header_scan_pages" not in tier.stats()
        assert {"after", "late"} <= set(ready_keys(tier))
    newest = _journal_live(tmp_path)
    assert newest["after"].seq > max(r.seq for k, r in newest.items() if k != "after")


def test_torn_write_trailer_without_payload_is_a_miss(tmp_path):
    """A trailer that landed while its payload did not (a torn write): adopted, then its read
    fails the payload checksum: a miss, never wrong bytes."""
    cfg = small_config(tmp_path)
    with Tier(LAYOUT, cfg, device="cpu") as tier:
        assert all(put(tier, ["a", "b"]))
        path, off = slot_location(tier, "a")
    with open(path, "r+b") as f:
        f.seek(off)
        f.write(bytes(PAGE))  # payload gone, trailer still there
    os.unlink(tmp_path / JOURNAL)
    with Tier(LAYOUT, cfg, device="cpu") as tier:
        res = check_pages(tier, ["a", "b"])
        assert res["missed"] == ["a"] and not res["wrong"]


def test_trailers_of_another_store_are_not_adopted(tmp_path):
    """A slab file copied from another store (other store id) brings no pages in."""
    a, b = tmp_path / "a", tmp_path / "b"
    a.mkdir()
    b.mkdir()
    with Tier(LAYOUT, small_config(a), device="cpu") as tier:
        assert all(put(tier, ["x", "y"]))
    Tier(LAYOUT, small_config(b), device="cpu").close()
    for name in ("slab-000.bin", "slab-001.bin"):
        (b / name).write_bytes((a / name).read_bytes())
    for name in (MANIFEST, MANIFEST_COPY):  # keep b's inodes valid: the files are b's now
        m = json.loads((b / name).read_text())
        m["slab_inodes"] = [os.stat(b / n).st_ino for n in ("slab-000.bin", "slab-001.bin")]
        body = {k: v for k, v in m.items() if k != "checksum"}
        m["checksum"] = crc32c.crc32c(json.dumps(body, sort_keys=True).encode())
        (b / name).write_text(json.dumps(m))
    os.unlink(b / JOURNAL)
    with Tier(LAYOUT, small_config(b), device="cpu") as tier:
        assert len(tier.directory) == 0


def test_verify_off_does_not_adopt_unverifiable_pages(tmp_path):
    cfg = small_config(tmp_path, verify=False)
    with Tier(LAYOUT, cfg, device="cpu") as tier:
        assert all(put(tier, ["a"]))
    os.unlink(tmp_path / JOURNAL)
    with Tier(LAYOUT, cfg, device="cpu") as tier:
        assert len(tier.directory) == 0


def test_format_1_store_is_refused(tmp_path):
    with Tier(LAYOUT, small_config(tmp_path), device="cpu") as tier:
        assert all(put(tier, ["a"]))
    for name in (MANIFEST, MANIFEST_COPY):
        m = json.loads((tmp_path / name).read_text())
        m.update(format_version=1, fingerprint=m["fingerprint"].replace("/v2|", "/v1|"))
        del m["checksum"]
        (tmp_path / name).write_text(json.dumps(m))
    before = sorted((p.name, p.stat().st_size) for p in tmp_path.iterdir())
    with pytest.raises(StoreMismatchError, match="on-disk format version 1; this gdskv reads "
                       "version 2 only"):
        Tier(LAYOUT, small_config(tmp_path), device="cpu")
    assert sorted((p.name, p.stat().st_size) for p in tmp_path.iterdir()) == before


def test_header_scan_speed(tmp_path):
    """20k slots scanned well inside the budget (100k in <= 10 s is the GPU-disk target;
    bench/experiments/recovery_bench.py --scan measures it)."""
    import recovery_bench
    os.chmod(tmp_path, 0o700)
    recovery_bench.build(str(tmp_path), 20_000, puts=False)
    recovery_bench.close_trailer_files()
    seconds = recovery_bench.measure(str(tmp_path), 20_000, scan=True)
    print(f"header scan recovery of 20000 pages: {seconds:.3f} s")
    assert seconds < 4.0


def test_cleared_pages_do_not_come_back(tmp_path):
    """clear gives the store a new id: the old trailers are foreign to a later header scan."""
    cfg = small_config(tmp_path)
    with Tier(LAYOUT, cfg, device="cpu") as tier:
        assert all(put(tier, ["a", "b"]))
        tier.clear()
        assert all(put(tier, ["c"]))
    os.unlink(tmp_path / JOURNAL)
    with Tier(LAYOUT, cfg, device="cpu") as tier:
        assert ready_keys(tier) == ["c"]
        assert not check_pages(tier, ["c"])["missed"]


def test_forced_scan_reports_progress_over_every_slot(tmp_path):
    """Tier(scan_headers=True) scans even a whole journal (gdskv rebuild); scan_progress hears
    of every slot once (it drives the command's progress bar)."""
    import threading
    cfg = small_config(tmp_path)
    with Tier(LAYOUT, cfg, device="cpu") as tier:
        assert all(put(tier, ["a", "b"]))
    done, lock = [0], threading.Lock()

    def progress(n):
        with lock:
            done[0] += n

    with Tier(LAYOUT, cfg, device="cpu", scan_headers=True, scan_progress=progress) as tier:
        assert done[0] == tier.store.num_slots
        assert set(ready_keys(tier)) == {"a", "b"} and "header_scan_pages" in tier.stats()


def _put_version(tier, key, version: str) -> bool:
    """Put ``key`` with the bytes of ``key@version`` (versions of one key differ)."""
    return tier.put_pages([key], [[page_content(f"{key}@{version}")]])[0]


def _served_version(tier, key, versions) -> str | None:
    out = torch.zeros(PAGE, dtype=torch.uint8)
    if not tier.get_pages([key], [[out]])[0]:
        return None
    return next(v for v in versions if torch.equal(out, page_content(f"{key}@{v}")))


def test_rebuild_keeps_evicted_pages_evicted(tmp_path, capsys):
    """gdskv rebuild over an intact journal (issue 46, item 5): the pages the journal saw
    evicted stay evicted, whether their slots were reused or not."""
    from gdskv import cli
    cfg = small_config(tmp_path)
    keys = [f"p{i}" for i in range(40)]
    with Tier(LAYOUT, cfg, device="cpu") as tier:
        assert all(put(tier, keys))
        tier.evict(keys[:24])
        assert all(put(tier, ["n0", "n1", "n2", "n3"]))  # 4 of the 24 slots reused
    assert cli.main(["rebuild", str(tmp_path), "--json"]) == 0
    capsys.readouterr()
    with Tier(LAYOUT, cfg, device="cpu") as tier:
        back = sorted(set(keys[:24]) & set(ready_keys(tier)))
        print(f"rebuild: {len(back)} of 24 evicted pages came back")
        assert not back
        assert check_pages(tier, keys[24:] + ["n0", "n1", "n2", "n3"])["hits"] == 20


def test_rebuild_never_serves_an_older_version_of_an_evicted_key(tmp_path, capsys):
    """A key's newest version evicted and its slot reused; its older version's trailer is
    still in another slot. rebuild must not bring that older version back."""
    from gdskv import cli
    cfg = small_config(tmp_path)
    fill = [f"f{i}" for i in range(10)]
    with Tier(LAYOUT, cfg, device="cpu") as tier:
        assert all(put(tier, fill))
        assert _put_version(tier, "K", "v1")
        tier.evict(["f0", "K"])  # two slots free: v2 takes the lower one (f0's)
        assert _put_version(tier, "K", "v2")
        tier.evict(["K"])
        assert all(put(tier, ["reuse"]))  # v2's slot reused; v1's trailer still on disk
    assert cli.main(["rebuild", str(tmp_path), "--json"]) == 0
    capsys.readouterr()
    with Tier(LAYOUT, cfg, device="cpu") as tier:
        assert _served_version(tier, "K", ["v1", "v2"]) is None
        assert check_pages(tier, fill[1:] + ["reuse"])["hits"] == 10
