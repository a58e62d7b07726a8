"""Dropping the page cache before read phases, as fio's ``invalidate=1`` does, and saying how.

By default only the job's own files: ``posix_fadvise(DONTNEED)`` on each after ``fdatasync``
(dirty pages cannot be dropped), which any user may do for their own files and which touches
nothing else on the machine. Asked for explicitly (``machine_wide``, gdskv-bench's
``--drop_caches``), also ``1`` into ``/proc/sys/vm/drop_caches`` after ``sync()``: root only, and
a system-wide side effect, so never a default. On tmpfs (``/dev/shm``) the page cache *is* the
storage: nothing can be dropped and the report says so.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any

from .measurements import plural

DROP_CACHES = "/proc/sys/vm/drop_caches"


def fs_type(path: str) -> str:
    """File system type of the mount holding ``path`` (from /proc/mounts), or "unknown"."""
    path = os.path.realpath(path)
    best, kind = "", "unknown"
    try:
        with open("/proc/mounts", encoding="utf-8") as f:
            for line in f:
                parts = line.split()
                if len(parts) < 3:
                    continue
                mnt = parts[1].replace("\\040", " ")
                if (path == mnt or path.startswith(mnt.rstrip("/") + "/")) and len(mnt) > len(best):
                    best, kind = mnt, parts[2]
    except OSError:
        pass
    return kind


def drop_page_cache(files: Sequence[str], *, machine_wide: bool = False) -> dict[str, Any]:
    """Drop cached pages of ``files``; returns what was done (for the JSON report)."""
    advised, errors = 0, []
    for path in files:
        try:
            fd = os.open(path, os.O_RDONLY)
        except OSError as exc:
            errors.append(f"{path}: {exc.strerror}")
            continue
        try:
            os.fdatasync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            advised += 1
        except OSError as exc:
            errors.append(f"{path}: {exc.strerror}")
        finally:
            os.close(fd)
    dropped, why = False, "not asked (--drop_caches=0)"
    if machine_wide and not (hasattr(os, "geteuid") and os.geteuid() == 0):
        why = "not root"
    elif machine_wide:
        try:
            os.sync()
            with open(DROP_CACHES, "w", encoding="ascii") as f:
                f.write("1\n")
            dropped, why = True, "ok"
        except OSError as exc:
            why = f"{DROP_CACHES}: {exc.strerror}"
    kinds = sorted({fs_type(os.path.dirname(p) or ".") for p in files})
    in_ram = bool(kinds) and all(k in ("tmpfs", "ramfs") for k in kinds)
    if in_ram:
        summary = f"not droppable: files on {'/'.join(kinds)} (RAM is the storage)"
    elif dropped or (files and advised == len(files)):
        summary = ("dropped (" + ", ".join(
            x for x in (f"fadvise DONTNEED on {plural(advised, 'file')}" if advised else "",
                        "the machine's, drop_caches" if dropped else "") if x) + ")")
    else:
        summary = f"NOT dropped ({'; '.join(errors[:2]) or why})"
    return {"done": bool(dropped or (files and advised == len(files))) and not in_ram,
            "fadvise_files": advised, "files": len(files), "drop_caches": dropped,
            "drop_caches_status": why, "fs_types": kinds, "in_ram": in_ram,
            "errors": errors[:5], "summary": summary}
