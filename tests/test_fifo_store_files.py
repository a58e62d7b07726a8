"""A FIFO (or another non-regular file) in place of a slab file (issue 46, item 7): every entry
point that opens store files refuses it with one clear message at once, never blocking in
open(O_RDONLY) (on a shared mount, one node could otherwise freeze the others' start-up)."""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import threading

import pytest

from gdskv import cli
from gdskv.cluster import ClusterStore
from gdskv.store import StoreError
from gdskv.tier import Tier
from cluster_helpers import cluster_config
from reliability_helpers import LAYOUT, put, small_config

#: seconds an entry point may take before it counts as blocked
LIMIT = 20


def _store_with_fifo(directory) -> str:
    directory.mkdir(mode=0o700, parents=True)
    with Tier(LAYOUT, small_config(directory), device="cpu") as tier:
        assert all(put(tier, ["a", "b"]))
    fifo = str(directory / "slab-001.bin")
    os.unlink(fifo)
    os.mkfifo(fifo, 0o600)
    return fifo


def _within_limit(fn, fifo: str):
    """``fn()``'s result or exception, run on a thread; a call still blocked after LIMIT s is
    released (a writer opens the FIFO's other end) and fails the test."""
    out: dict = {}

    def run():
        try:
            out["result"] = fn()
        except BaseException as exc:  # noqa: BLE001 - handed to the test
            out["error"] = exc

    th = threading.Thread(target=run, daemon=True)
    th.start()
    th.join(LIMIT)
    if th.is_alive():
        for _ in range(50):  # unblock the reader stuck in open()
            with contextlib.suppress(OSError):
                os.close(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))
            th.join(0.1)
            if not th.is_alive():
                break
        pytest.fail(f"blocked for more than {LIMIT} s opening {fifo}")
    return out


def _cli(argv):
    try:
        return cli.main(argv)
    except SystemExit as exc:
        return exc.code


@pytest.mark.parametrize("command", ["info", "verify"])
def test_cli_refuses_a_fifo_slab(tmp_path, command, capsys):
    fifo = _store_with_fifo(tmp_path / "store")
    out = _within_limit(lambda: _cli([command, str(tmp_path / "store")]), fifo)
    assert out.get("result") == 2, out
    err = capsys.readouterr().err
    assert "slab-001.bin" in err and "not a regular file (a FIFO)" in err, err


def test_read_only_follower_refuses_a_fifo_slab(tmp_path):
    fifo = _store_with_fifo(tmp_path / "store")
    out = _within_limit(lambda: Tier(LAYOUT, small_config(tmp_path / "store", read_only=True),
                                     device="cpu"), fifo)
    assert isinstance(out.get("error"), StoreError), out
    assert "not a regular file (a FIFO)" in str(out["error"])


def test_cluster_node_skips_a_peer_with_a_fifo_slab(tmp_path, caplog):
    root = tmp_path / "shared"
    root.mkdir(mode=0o700)
    with ClusterStore(LAYOUT, cluster_config(str(root), "bad"), device="cpu") as bad:
        assert all(put(bad, ["x"]))
    fifo = str(root / "bad" / "slab-001.bin")
    os.unlink(fifo)
    os.mkfifo(fifo, 0o600)
    with caplog.at_level(logging.INFO, logger="gdskv.cluster"):
        out = _within_limit(lambda: ClusterStore(LAYOUT, cluster_config(str(root), "good"),
                                                 device="cpu"), fifo)
    assert "result" in out, out
    with out["result"] as node:
        assert "bad" not in node.peers
    assert "not a regular file (a FIFO)" in caplog.text
    out = _within_limit(lambda: _cli(["cluster", "list", str(root), "--json"]), fifo)
    assert out.get("result") == 0, out


def test_open_regular_refuses_what_is_not_a_regular_file(tmp_path):
    """The helper the store (and the cluster listing) open files with: no blocking, no
    following links, one message naming the kind of file."""
    from gdskv.store import open_regular
    os.mkfifo(tmp_path / "fifo", 0o600)
    os.symlink(tmp_path / "fifo", tmp_path / "link")
    with pytest.raises(StoreError, match=r"not a regular file \(a FIFO\)"):
        open_regular(str(tmp_path / "fifo"), os.O_RDONLY)
    with pytest.raises(StoreError, match=r"not a regular file \(a directory\)"):
        open_regular(str(tmp_path), os.O_RDONLY)
    with pytest.raises(StoreError, match="is a symlink") as link:
        open_regular(str(tmp_path / "link"), os.O_RDONLY)
    assert link.value.errno == errno.ELOOP
    (tmp_path / "file").write_bytes(b"x")
    fd = open_regular(str(tmp_path / "file"), os.O_RDONLY)
    try:
        assert os.read(fd, 1) == b"x"
        import fcntl
        assert not fcntl.fcntl(fd, fcntl.F_GETFL) & os.O_NONBLOCK
    finally:
        os.close(fd)
