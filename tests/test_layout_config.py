"""KVLayout geometry and TierConfig / GDSKV_* parsing."""

from __future__ import annotations

import pytest
import torch

from gdskv.config import BackendKind, ConfigError, DirectIO, TierConfig, parse_size
from gdskv.layout import KVLayout


def test_llama3_8b_geometry():
    lay = KVLayout(num_layers=32, page_size=16, head_dim=128, kv_heads=8, dtype=torch.bfloat16)
    assert lay.dtype == "bfloat16" and lay.row_bytes == 2048
    assert lay.page_bytes == 2 * 32 * 16 * 2048 == 2 << 20
    assert lay.slot_bytes == (2 << 20) + 4096  # no padding left: the trailer takes a block


def test_mla_geometry_and_padding():
    lay = KVLayout(num_layers=61, page_size=1, head_dim=576, mla=True, dtype="bf16")
    assert lay.kv_count == 1 and lay.page_bytes == 61 * 1152
    assert lay.slot_bytes % 4096 == 0 and lay.slot_bytes - lay.page_bytes < 4096


def test_fingerprint_names_everything():
    a = KVLayout(32, 16, 128, 8, "bf16", model_name="m", tp_rank=1, tp_size=2)
    for other in (a.replace(model_name="n"), a.replace(tp_rank=0), a.replace(page_size=64),
                  a.replace(dtype="fp16"), a.replace(kv_heads=4), a.replace(num_layers=31)):
        assert other.fingerprint != a.fingerprint


@pytest.mark.parametrize("kwargs, match", [
    (dict(num_layers=0), "num_layers"), (dict(page_size=257), "page_size"),
    (dict(page_size=0), "page_size"), (dict(dtype="int8"), "dtype"),
    (dict(mla=True, kv_heads=2), "MLA"), (dict(tp_rank=2, tp_size=2), "tp_rank"),
    (dict(head_dim=1.5), "head_dim"), (dict(model_name="a|b"), "model_name"),
])
def test_layout_rejects_bad_values(kwargs, match):
    base = dict(num_layers=2, page_size=16, head_dim=64)
    base.update(kwargs)
    with pytest.raises(ValueError, match=match):
        KVLayout(**base)


@pytest.mark.parametrize("text, value", [("4096", 4096), ("4k", 4096), ("64MiB", 64 << 20),
                                         ("2G", 2 << 30), ("1.5k", 1536), ("1MB", 10**6),
                                         ("1kb", 1000)])
def test_parse_size(text, value):
    assert parse_size(text) == value


def test_from_env_reads_every_kind():
    env = {"GDSKV_DIRECTORIES": "/a:/b", "GDSKV_CAPACITY": "64GiB", "GDSKV_BACKEND": "nixl",
           "GDSKV_STAGING_SIZE": "32M", "GDSKV_IO_THREADS": "16", "GDSKV_DIRECT_IO": "off",
           "GDSKV_EVICTION": "none", "GDSKV_VERIFY": "false", "GDSKV_NIXL_PLUGIN": "gds_mt",
           "PATH": "/usr/bin"}
    cfg = TierConfig.from_env(env)
    assert cfg.directories == ("/a", "/b") and cfg.capacity == 64 << 30
    assert cfg.backend is BackendKind.NIXL and cfg.staging_size == 32 << 20
    assert cfg.io_threads == 16 and cfg.direct_io is DirectIO.OFF and cfg.verify is False
    assert cfg.nixl_plugin.value == "GDS_MT"
    assert TierConfig.from_env(env, io_threads=2).io_threads == 2  # overrides win


def test_a_misspelt_field_gets_the_did_you_mean_of_a_misspelt_variable():
    for make in (lambda: TierConfig(capacty="1GiB"), lambda: TierConfig().replace(capacty=1),
                 lambda: TierConfig.from_env({}, capacty="1GiB")):
        with pytest.raises(TypeError, match=r"unknown field capacty=.* \(did you mean "
                                            r"capacity\?\); known: directories, capacity, "):
            make()
    with pytest.raises(ConfigError, match="did you mean io_threads"):  # what the CLIs catch
        TierConfig(io_thread=4)
    with pytest.raises(ConfigError, match=r"unknown field zzz=1; known: "):  # nothing close
        TierConfig(zzz=1)
    assert TierConfig(capacity="1GiB").capacity == 1 << 30  # a real field goes through


@pytest.mark.parametrize("var, value, match", [
    ("GDSKV_CAPACITTY", "1G", "unknown environment variable GDSKV_CAPACITTY"),
    ("GDSKV_CAPACITY", "lots", "GDSKV_CAPACITY='lots'"),
    ("GDSKV_BACKEND", "floppy", "GDSKV_BACKEND='floppy'"),
    ("GDSKV_IO_THREADS", "0", "GDSKV_IO_THREADS='0'"),
    ("GDSKV_IO_THREADS", "many", "GDSKV_IO_THREADS='many'"),
    ("GDSKV_VERIFY", "maybe", "GDSKV_VERIFY='maybe'"),
    ("GDSKV_IO_CHUNK_SIZE", "1000", "GDSKV_IO_CHUNK_SIZE='1000'"),
])
def test_from_env_errors_name_the_variable(var, value, match):
    with pytest.raises(ConfigError, match=match):
        TierConfig.from_env({var: value})


def test_staging_part_holds_a_round_number_of_pages():
    # 2 MiB pages carry a 4 KiB trailer block: a 64 MiB part (256 MiB / 4) holds 32 pages,
    # not 31, so a 128-page call is 4 chunks (one per part), not 5.
    from gdskv.layout import BytePageLayout
    from gdskv.staging import PART_SLACK, staging_part_pages
    lay = KVLayout(num_layers=32, page_size=16, head_dim=128, kv_heads=8, dtype=torch.bfloat16)
    assert staging_part_pages(64 << 20, lay) == 32
    assert 32 * lay.slot_bytes <= (64 << 20) * (1 + PART_SLACK)
    assert staging_part_pages((2 << 20) - 1, lay) == 0   # not one page of payload
    # Tiny pages: a slot (4 KiB) is many times the payload, so whole slots bound the part.
    tiny = BytePageLayout(page_bytes=100, kind="test/tiny")
    assert tiny.slot_bytes == 4096
    assert staging_part_pages(64 << 10, tiny) == 16
