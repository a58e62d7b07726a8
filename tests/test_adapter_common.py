"""The glue the engine adapters share (gdskv.adapters.common) and the log-once helper
(gdskv.log_once). Each adapter's own tests (tests/test_<engine>_*.py, in the engine's venv)
drive the same code through the engine's real classes."""

from __future__ import annotations

import logging
import os

import pytest

from gdskv.adapters.common import (StoreDirectoryError, check_store_directories, shard_name,
                                   store_directories, tier_config)
from gdskv.config import ConfigError, Eviction
from gdskv.log_once import LogOnce
from gdskv.store import StoreError

WHERE = "adapter_params"


# -- options -> TierConfig ---------------------------------------------------------------------
def test_options_become_a_tier_config(tmp_path, monkeypatch):
    monkeypatch.setenv("GDSKV_IO_THREADS", "3")
    monkeypatch.setenv("GDSKV_CAPACITY", "1GiB")
    config = tier_config({"directories": [str(tmp_path)], "capacity": "8MiB", "eviction": "none",
                          "object_bytes": 5, "module_path": "x"}, where=WHERE,
                         adapter_keys={"object_bytes"}, engine_keys={"module_path"})
    assert config.directories == (str(tmp_path),)  # a JSON list, as a tuple
    assert config.capacity == 8 << 20  # the options win over GDSKV_*
    assert config.io_threads == 3      # which fill in the rest
    assert config.eviction is Eviction.NONE


def test_unknown_key_is_refused_with_the_closest_known_one(tmp_path):
    with pytest.raises(ConfigError) as info:
        tier_config({"directories": str(tmp_path), "capcity": "1G", "object_byte": 4},
                    where=WHERE, adapter_keys={"object_bytes"})
    message = str(info.value)
    assert message.startswith("gdskv: unknown adapter_params key 'capcity' (did you mean "
                              "capacity?); 'object_byte' (did you mean object_bytes?); known: ")
    assert "create_directories" in message and "object_bytes" in message
    # a key the engine itself adds is neither refused nor offered as a suggestion
    with pytest.raises(ConfigError) as info:
        tier_config({"directories": str(tmp_path), "module_pth": 1}, where=WHERE,
                    engine_keys={"module_path"})
    assert "did you mean" not in str(info.value) and "module_path" not in str(info.value)


@pytest.mark.parametrize("options, match", [
    ({"capacity": "lots"}, r"^gdskv: adapter_params: capacity: cannot parse size"),
    ({"io_threads": 0}, r"^gdskv: adapter_params: io_threads"),
    ({"create_directories": "maybe"}, r"create_directories: expected a boolean"),
])
def test_bad_values_name_the_option(tmp_path, options, match):
    with pytest.raises(ConfigError, match=match):
        tier_config({"directories": str(tmp_path), **options}, where=WHERE)


def test_options_must_be_an_object():
    with pytest.raises(ConfigError, match=r"adapter_params must be an object of gdskv options, "
                       r"got list"):
        tier_config(["directories"], where=WHERE)


# -- store directories --------------------------------------------------------------------------
def test_one_error_class_for_a_missing_or_unusable_directory(tmp_path, monkeypatch):
    # old callers caught ConfigError / ValueError (vLLM, LMCache, SGLang) or StoreError /
    # OSError (a Tier opened on a missing directory): each still catches it
    assert issubclass(StoreDirectoryError, ConfigError) and issubclass(StoreDirectoryError,
                                                                       ValueError)
    assert issubclass(StoreDirectoryError, StoreError) and issubclass(StoreDirectoryError,
                                                                      OSError)
    monkeypatch.delenv("GDSKV_DIRECTORIES", raising=False)
    with pytest.raises(StoreDirectoryError, match=r"no store directory: set \"directories\" "
                       r"in adapter_params or GDSKV_DIRECTORIES"):
        tier_config({}, where=WHERE)
    missing = tmp_path / "nvme0" / "kv"
    with pytest.raises(StoreDirectoryError, match=r"directories: '.*nvme0/kv' does not exist "
                       r"\(an unmounted drive\?\).*\"create_directories\": true in "
                       r"adapter_params"):
        tier_config({"directories": str(missing)}, where=WHERE)
    assert not (tmp_path / "nvme0").exists()
    (tmp_path / "file").write_text("")
    with pytest.raises(StoreDirectoryError, match=r"'.*file' exists but is not a directory"):
        tier_config({"directories": str(tmp_path / "file")}, where=WHERE)
    tier_config({"directories": str(missing), "create_directories": True}, where=WHERE)
    assert missing.is_dir() and (os.stat(missing).st_mode & 0o777) == 0o700
    # where the options cannot ask for creation, the message does not offer it
    with pytest.raises(StoreDirectoryError) as info:
        check_store_directories([str(tmp_path / "gone")], where="GDSKV_DIRECTORIES",
                                can_create=False)
    assert "create_directories" not in str(info.value)


# -- per-rank store naming ----------------------------------------------------------------------
@pytest.mark.parametrize("ranks, name", [
    ({}, "tp0-of-1"),
    ({"tp_rank": 1, "tp_size": 2}, "tp1-of-2"),
    ({"tp_rank": 1, "tp_size": 2, "pp_rank": 1, "pp_size": 2}, "tp1-of-2_pp1-of-2"),
    ({"tp_size": 2, "cp_rank": 1, "cp_size": 2, "dp_rank": 3}, "tp0-of-2_cp1-of-2_dp3"),
    ({"tp_rank": 1, "tp_size": 2, "same_on_tp_ranks": True}, "tp-all"),
    ({"dp_rank": 3, "cluster": True}, "tp0-of-1"),  # each DP rank is a node of the cluster
])
def test_shard_names(ranks, name):
    assert shard_name(**ranks) == name


def test_store_directories_are_model_store_shard(tmp_path):
    roots = [str(tmp_path / "a"), str(tmp_path / "b")]
    dirs = store_directories(roots, "org/Model 7B", "kv", "tp0-of-2")
    assert dirs == tuple(os.path.join(r, "org-Model-7B", "kv", "tp0-of-2") for r in roots)
    assert not any(os.path.exists(d) for d in dirs)  # a reader makes nothing
    assert store_directories(roots, "org/Model 7B", "kv", "tp0-of-2", create=True) == dirs
    assert all(os.path.isdir(d) for d in dirs)


def test_an_upgrade_keeps_the_store_of_the_earlier_name(tmp_path, caplog):
    """A user upgrading must not silently lose a warm cache: the store under the name an
    earlier gdskv gave it stays in use while the current name holds nothing, said once."""
    roots = [str(tmp_path / "a"), str(tmp_path / "b")]
    old = os.path.join("m", "tp0-1")
    for r in roots:
        os.makedirs(os.path.join(r, old))
        open(os.path.join(r, old, "gdskv-manifest.json"), "w").close()
    with caplog.at_level(logging.WARNING, logger="gdskv.adapters"):
        for _ in range(2):  # e.g. the writer rank and a reader rank of one engine
            dirs = store_directories(roots, "m", "kv", "tp0-of-1", earlier=[old], create=True)
            assert dirs == tuple(os.path.join(r, old) for r in roots)
    said = [r.getMessage() for r in caplog.records if "earlier gdskv" in r.getMessage()]
    assert len(said) == 1 and os.path.join("m", "kv", "tp0-of-1") in said[0]
    assert not os.path.exists(os.path.join(roots[0], "m", "kv"))  # nothing made beside it


def test_the_current_name_wins_once_it_holds_a_store(tmp_path):
    root = str(tmp_path)
    os.makedirs(os.path.join(root, "m", "tp0-1"))  # an earlier reader's empty directory
    new = os.path.join(root, "m", "kv", "tp0-of-1")
    assert store_directories([root], "m", "kv", "tp0-of-1", earlier=["m/tp0-1"]) == (new,)
    open(os.path.join(root, "m", "tp0-1", "gdskv-manifest.json"), "w").close()
    os.makedirs(new)
    open(os.path.join(new, "gdskv-manifest.json"), "w").close()
    assert store_directories([root], "m", "kv", "tp0-of-1", earlier=["m/tp0-1"]) == (new,)


# -- log once -----------------------------------------------------------------------------------
def test_log_once_per_tag(caplog):
    log = logging.getLogger("gdskv.test.once")
    once = LogOnce(log, prefix="gdskv: ")
    again = LogOnce(log, logging.ERROR, repeat_level=logging.DEBUG)
    with caplog.at_level(logging.DEBUG, logger="gdskv.test.once"):
        assert once("read", "read of %d pages failed", 3)
        assert not once("read", "read of %d pages failed", 4)
        assert once("write", "write failed", level=logging.INFO)
        again("x", "first")
        again("x", "second")
    assert [(r.levelno, r.getMessage()) for r in caplog.records] == [
        (logging.WARNING, "gdskv: read of 3 pages failed"), (logging.INFO, "gdskv: write failed"),
        (logging.ERROR, "first"), (logging.DEBUG, "second")]
