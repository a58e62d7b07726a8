"""The kvikio backend's decisions, with the real kvikio package on CPU.

kvikio imports, reads and sets its process-wide settings and opens its file handles without a
CUDA driver; only its I/O needs CUDA (that part runs in test_gpu_tier.py on the GPU machine).
Here: which process-wide settings the backend sets and which it leaves to the host process or
``KVIKIO_*``; that the task size goes with each call; and that the tier's ``o_direct`` is what
kvikio's handles and settings do, decided from the store's probe.
"""

from __future__ import annotations

import pytest

kvikio = pytest.importorskip("kvikio", reason="kvikio (kvikio-cu13, the gpu extra) is not installed")
import kvikio.defaults  # noqa: E402

import torch  # noqa: E402

from gdskv.backends import kvikio as kb  # noqa: E402
from gdskv.config import TierConfig  # noqa: E402
from gdskv.layout import KVLayout  # noqa: E402
from gdskv.store import SlabStore  # noqa: E402

LAYOUT = KVLayout(num_layers=2, page_size=4, head_dim=16, kv_heads=2, dtype="fp16")
KEYS = tuple(kb.KVIKIO_DEFAULTS)


@pytest.fixture(autouse=True)
def kvikio_at_defaults(monkeypatch):
    """Each test starts with kvikio's own defaults and no gdskv claim, and leaves the process's
    settings as they were."""
    saved = {k: kvikio.defaults.get(k) for k in KEYS}
    kvikio.defaults.set(dict(kb.KVIKIO_DEFAULTS))
    monkeypatch.setattr(kb, "_set_by_gdskv", {})
    for names in kb.KVIKIO_ENV.values():
        for name in names:
            monkeypatch.delenv(name, raising=False)
    yield
    kvikio.defaults.set(saved)


def test_our_defaults_table_is_kvikios():
    """KVIKIO_DEFAULTS must be what this kvikio starts with, or 'still at the default' would
    misjudge who set a value (run in a fresh process: this one's settings may be changed)."""
    import json
    import subprocess
    import sys
    env = {k: v for k, v in __import__("os").environ.items() if not k.startswith("KVIKIO_")}
    got = subprocess.run([sys.executable, "-c", "import json, kvikio.defaults as d; print(json."
                          f"dumps({{k: d.get(k) for k in {list(KEYS)!r}}}))"],
                         capture_output=True, text=True, env=env, check=True).stdout
    assert json.loads(got) == kb.KVIKIO_DEFAULTS


def test_settings_at_kvikios_defaults_are_set_and_logged_once(caplog):
    want = {"num_threads": 8, "bounce_buffer_size": 2 << 20, "auto_direct_io_read": True,
            "auto_direct_io_write": True}
    with caplog.at_level("INFO", logger="gdskv.kvikio"):
        got = kb.claim_settings(want)
        again = kb.claim_settings(want)  # a second tier with the same wishes
    assert got == {k: (v, "gdskv") for k, v in want.items()}
    assert {k: kvikio.defaults.get(k) for k in want} == want
    assert again == {k: (v, "gdskv (an earlier tier)") for k, v in want.items()}
    lines = [r.getMessage() for r in caplog.records if "settings in force" in r.getMessage()]
    assert len(lines) == 2 and "num_threads=8 (gdskv)" in lines[0]


def test_settings_the_host_or_env_chose_stand():
    kvikio.defaults.set("num_threads", 3)  # the engine configured kvikio itself
    env = {"KVIKIO_BOUNCE_BUFFER_SIZE": str(16 << 20)}  # as if set when kvikio started
    got = kb.claim_settings({"num_threads": 8, "bounce_buffer_size": 2 << 20,
                             "auto_direct_io_read": True}, environ=env)
    assert got["num_threads"] == (3, "the host process")
    assert got["bounce_buffer_size"] == (16 << 20, "KVIKIO_BOUNCE_BUFFER_SIZE")
    assert got["auto_direct_io_read"] == (True, "gdskv")
    assert kvikio.defaults.get("num_threads") == 3
    assert kvikio.defaults.get("bounce_buffer_size") == 16 << 20


def test_an_earlier_tiers_setting_is_not_changed_under_it():
    kb.claim_settings({"auto_direct_io_read": True})
    got = kb.claim_settings({"auto_direct_io_read": False})  # a tier on a store without O_DIRECT
    assert got == {"auto_direct_io_read": (True, "gdskv (an earlier tier)")}
    assert kvikio.defaults.get("auto_direct_io_read") is True


@pytest.fixture
def kvikio_on_store(tmp_path):
    """A KvikioBackend attached to a real store's slab files (built directly: on a host without
    the CUDA driver a Tier refuses backend=kvikio, see test_hardening.py)."""
    opened = []

    def make(**overrides):
        base = dict(directories=(str(tmp_path),), capacity="4MiB", staging_size="256KiB",
                    io_chunk_size="64KiB", backend="kvikio")
        cfg = TierConfig(**{**base, **overrides})
        store = SlabStore(LAYOUT, cfg)
        backend = kb.KvikioBackend(cfg, "cpu")
        backend.selected_because = "asked for by config"
        backend.attach(store.files)
        opened.append((backend, store))
        return backend, store

    yield make
    for backend, store in opened:
        backend.close()
        store.close()


@pytest.mark.parametrize("direct_io", ["auto", "off"])
def test_o_direct_is_what_kvikio_does(kvikio_on_store, direct_io):
    """The store probes O_DIRECT; the backend asks kvikio for the same and reports kvikio's
    handles and settings (what the tier's o_direct stat shows)."""
    backend, store = kvikio_on_store(direct_io=direct_io, io_threads=5)
    on, why = backend.direct_io()
    handles = all(f.is_direct_io_supported() for f in backend._files)
    compat = kvikio.defaults.is_compat_mode_preferred()
    in_force = (kvikio.defaults.get("auto_direct_io_read")
                and kvikio.defaults.get("auto_direct_io_write"))
    assert on == (handles and (in_force or not compat))
    assert on == (store.direct and handles)  # nobody else set them here
    assert "auto_direct_io_read" in why or not compat
    detail = backend.describe()
    assert detail["selected"] == "asked for by config"
    assert detail["settings"]["num_threads"] == {"value": 5, "set_by": "gdskv"}
    assert detail["task_size"] == 1 << 20  # a quarter of 64 KiB, at least 1 MiB


def test_host_setting_wins_and_o_direct_says_so(kvikio_on_store):
    kvikio.defaults.set("auto_direct_io_write", False)  # the host wants buffered writes
    backend, _ = kvikio_on_store()
    if not kvikio.defaults.is_compat_mode_preferred():
        pytest.skip("cuFile (GDS) runs: kvikio's auto_direct_io settings do not apply")
    on, why = backend.direct_io()
    assert on is False
    assert "auto_direct_io_write=False (set by the host process)" in why
    assert kvikio.defaults.get("auto_direct_io_write") is False


def test_task_size_goes_with_each_call(kvikio_on_store):
    """No process-wide task_size: each pread/pwrite carries the backend's own."""
    before = kvikio.defaults.get("task_size")
    backend, store = kvikio_on_store(io_chunk_size="8MiB")
    calls = []

    class Recorder:
        def pread(self, buf, size, offset, task_size=None):
            calls.append(task_size)
            raise OSError("recorded")  # kvikio's own I/O needs CUDA: not run here

    outcome = _one_slot(backend, store, Recorder, "read")
    assert calls == [2 << 20] and not outcome.ok
    assert outcome.failed == {0: [(0, LAYOUT.slot_bytes)]}
    assert kvikio.defaults.get("task_size") == before


@pytest.mark.parametrize("poll_us", [0, 5_000_000])
def test_a_wait_polls_kvikios_futures_first_when_asked(kvikio_on_store, poll_us):
    """io_poll_us: the waiting thread asks kvikio's futures whether they are done before it
    sleeps in their get(); off, it goes straight to get()."""
    backend, store = kvikio_on_store(io_poll_us=poll_us)
    events = []

    class Future:
        def __init__(self, n):
            self.n, self.asks = n, 0

        def done(self):
            self.asks += 1
            events.append("done?")
            return self.asks > 2

        def get(self):
            events.append("get")
            return self.n

    class Files:
        def pwrite(self, buf, size, offset, task_size=None):
            return Future(size)

    outcome = _one_slot(backend, store, Files, "write")
    assert outcome.ok and outcome.nbytes == LAYOUT.slot_bytes
    assert events == (["done?"] * 3 + ["get"] if poll_us else ["get"])
    assert backend.describe()["io_poll_us"] == poll_us


def _one_slot(backend, store, fake_file, op: str):
    """``op`` one slot through ``backend`` with each kvikio file handle replaced by a
    ``fake_file()`` (kvikio's own I/O needs CUDA); the call's outcome."""
    real, backend._files = backend._files, [fake_file() for _ in backend._files]
    try:
        buf = torch.zeros(LAYOUT.slot_bytes, dtype=torch.uint8)
        return getattr(backend, op)(buf, store.extents([0])).result()
    finally:
        backend._files = real
