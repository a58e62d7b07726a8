"""A ``dd`` baseline: what one sequential O_DIRECT stream gets from the same directory.

``python bench/device/ddbase.py --directory D --size 1G --bs 64M [--json FILE]`` writes a file
with ``dd oflag=direct conv=fdatasync``, drops its page cache, reads it back with
``dd iflag=direct``, and reports both rates in a fio-like JSON (``jobs[0].write/read.bw_bytes``)
so the results script can put it in the same table. Where O_DIRECT is refused (tmpfs), it runs
buffered and says so.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time

from gdskv.config import parse_size

from gdskv.bench.cache import drop_page_cache, fs_type

_RATE = re.compile(r"(\d+) bytes .* copied, ([\d.eE+-]+) s")


def _dd(args: list[str]) -> tuple[int, float]:
    p = subprocess.run(["dd", *args], capture_output=True, text=True, env={**os.environ,
                                                                             "LC_ALL": "C"})
    if p.returncode != 0:
        raise OSError(p.returncode, p.stderr.strip().splitlines()[-1] if p.stderr else "dd failed")
    m = _RATE.search(p.stderr)
    if not m:
        raise RuntimeError(f"cannot parse dd output: {p.stderr!r}")
    return int(m.group(1)), float(m.group(2))


def dd_baseline(directory: str, size: int, bs: int) -> dict:
    count = max(1, size // bs)
    path = tempfile.mktemp(prefix="gdskv-dd-", suffix=".bin", dir=directory)
    notes = []
    direct = True
    try:
        try:
            wbytes, wsecs = _dd(["if=/dev/zero", f"of={path}", f"bs={bs}", f"count={count}",
                                 "oflag=direct", "conv=fdatasync"])
        except OSError as exc:
            notes.append(f"oflag=direct refused ({exc.strerror}): buffered dd")
            direct = False
            wbytes, wsecs = _dd(["if=/dev/zero", f"of={path}", f"bs={bs}", f"count={count}",
                                 "conv=fdatasync"])
        inv = drop_page_cache([path])
        rargs = ["of=/dev/null", f"if={path}", f"bs={bs}"] + (["iflag=direct"] if direct else [])
        rbytes, rsecs = _dd(rargs)
    finally:
        if os.path.exists(path):
            os.unlink(path)

    def d(nbytes: int, secs: float) -> dict:
        return {"io_bytes": nbytes, "bw_bytes": int(nbytes / secs) if secs else 0,
                "runtime": int(secs * 1000)}

    return {"fio version": "dd", "time": time.strftime("%a %b %d %H:%M:%S %Y"),
            "jobs": [{"jobname": "dd", "groupid": 0, "error": 0,
                      "write": d(wbytes, wsecs), "read": d(rbytes, rsecs),
                      "gdskv": {"engine": "dd", "backend": "dd", "o_direct": direct,
                                "fs_types": [fs_type(directory)], "bs": bs,
                                "invalidate": inv, "note": "; ".join(notes)}}]}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python bench/device/ddbase.py", description=__doc__)
    p.add_argument("--directory", required=True)
    p.add_argument("--size", default="1G")
    p.add_argument("--bs", default="64M")
    p.add_argument("--json", default=None, help="also write the JSON here")
    a = p.parse_args(argv)
    doc = dd_baseline(a.directory, parse_size(a.size), parse_size(a.bs))
    text = json.dumps(doc, indent=2)
    if a.json:
        with open(a.json, "w", encoding="utf-8") as f:
            f.write(text + "\n")
    job = doc["jobs"][0]
    print(f"dd {a.directory} ({'O_DIRECT' if job['gdskv']['o_direct'] else 'buffered'}): "
          f"write {job['write']['bw_bytes'] / 1e9:.2f} GB/s, "
          f"read {job['read']['bw_bytes'] / 1e9:.2f} GB/s", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
