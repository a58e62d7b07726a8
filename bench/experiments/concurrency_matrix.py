"""Issue 47's concurrency and latency matrix: 1-page calls from 1, 4 and 16 threads, gdskv
against raw on the same job, for each medium, page size and direction.

    . bench/device/device_check.sh
    python3 bench/experiments/concurrency_matrix.py --backend kvikio \\
        --dirs shm=/dev/shm/gdskv-cm disk=/var/tmp/gdskv-cm \\
        --tree after=. --tree before=/tmp/before --out "$OUT/cm.json"

Each cell is one ``gdskv-bench`` job run with ``--compare`` (ioengine gdskv, then raw, in one
process): ``numjobs`` threads on one tier (raw: on one store, each thread on slots of its own),
every call one page (``bs`` = the page), ``time_based`` for ``--runtime`` after ``--ramp``.
A restore is a read job (its pages laid out first, untimed, then read over and over); a spill
is a write job (a page already written is evicted, untimed, before it is written again; the
tier's and raw's fdatasync per call alike). Per cell: each engine's aggregate pages/s, its
per-call completion latency p50/p99 (gdskv-bench's clat, both engines), and gdskv/raw of each.

Geometry: Llama-3-8B's token shape (8 KV heads x 128, bf16, K and V: 4 KiB a token and layer)
with 16-token pages over 1, 4 or 32 layers: 64 KiB is one layer's 16-token block (vLLM's
per-layer block), 256 KiB four layers', 2 MiB the whole model's page (the ``llama3-8b`` preset
at ``page_tokens=16``). Other sizes: :func:`geometry`.

One gdskv-bench process per tree, medium and page size (its jobs: ops x thread counts), run by
``tree_bench.py`` from the tree given with ``--tree LABEL=DIR`` (default: this checkout). With
several trees, their processes alternate per group, the order reversed every other group, so a
machine that drifts weighs on each tree alike. Writes one JSON (cells only, no per-call
samples; each process's own JSON and stderr under ``--log-dir``) and prints a markdown table a
tree, a few kilobytes in all.

Results it produced: ``h100-2026-11-27/concurrency/`` (issue 47, before/after in each call);
``h100-2026-11-27/combine/`` (combining on and off, and ``calls_at_once`` 1/2/4, by
``--tree-env``).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import re
import shutil
import socket
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.realpath(__file__))
REPO = os.path.dirname(os.path.dirname(HERE))
TREE_BENCH = os.path.join(HERE, "tree_bench.py")

KiB, MiB = 1 << 10, 1 << 20
#: Llama-3-8B: 8 KV heads x 128 dims x bf16, K and V
TOKEN_LAYER_BYTES = 8 * 128 * 2 * 2
MODEL_LAYERS = 32
PAGE_TOKENS = 16
MAX_PAGE_TOKENS = 256  # gdskv-bench's page_tokens bound
OPS = {"restore": "read", "spill": "write"}  # op -> gdskv-bench rw (and report direction)
#: rough costs for --dry-run's estimate: a process's start (torch, CUDA, kvikio) and an
#: engine's open, layout and close around its timed phase
START_S, ENGINE_S = 6.0, 1.0


def geometry(page_bytes: int) -> tuple[int, int]:
    """(layers, page_tokens) of Llama-3-8B's token shape that make a page of ``page_bytes``:
    16 tokens over as many layers as fit (up to the model's 32), fewer tokens under 64 KiB,
    more tokens over 32 layers."""
    units, rest = divmod(page_bytes, TOKEN_LAYER_BYTES)
    if rest or units < 1:
        raise ValueError(f"page size {page_bytes} is not a whole number of "
                         f"{TOKEN_LAYER_BYTES}-byte token-layers (e.g. 64KiB, 256KiB, 2MiB)")
    if units <= PAGE_TOKENS:
        return 1, units
    if units % PAGE_TOKENS == 0 and units // PAGE_TOKENS <= MODEL_LAYERS:
        return units // PAGE_TOKENS, PAGE_TOKENS
    if units % MODEL_LAYERS == 0 and units // MODEL_LAYERS <= MAX_PAGE_TOKENS:
        return MODEL_LAYERS, units // MODEL_LAYERS
    raise ValueError(f"page size {page_bytes}: no 16-token page of up to {MODEL_LAYERS} layers "
                     f"nor a {MODEL_LAYERS}-layer page of up to {MAX_PAGE_TOKENS} tokens makes "
                     "it (e.g. 64KiB, 256KiB, 2MiB)")


_SIZE_RE = re.compile(r"^\s*(\d+)\s*(?:([kmg])(?:i?b)?)?\s*$", re.IGNORECASE)


def parse_size(text: str) -> int:
    """``65536``, ``64k``, ``64KiB``, ``2MiB``: binary units, as gdskv's sizes."""
    m = _SIZE_RE.match(text)
    if not m:
        raise argparse.ArgumentTypeError(f"bad page size {text!r} (examples: 64KiB, 2MiB)")
    n = int(m.group(1)) << (10 * " kmg".index(m.group(2).lower()) if m.group(2) else 0)
    try:
        geometry(n)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    return n


def size_label(n: int) -> str:
    return f"{n // MiB} MiB" if n % MiB == 0 else f"{n // KiB} KiB" if n % KiB == 0 else f"{n} B"


def labelled(kind: str):
    """``LABEL=PATH`` or a bare ``PATH`` (labelled by itself)."""
    def parse(text: str) -> tuple[str, str]:
        label, sep, path = text.partition("=")
        if not sep or "/" in label:
            label, path = text, text
        if not label or not path:
            raise argparse.ArgumentTypeError(f"{kind} {text!r}: expected LABEL=PATH or PATH")
        return label, path
    return parse


def tree_env(settings: list[str], label: str) -> dict[str, str]:
    """The ``--tree-env LABEL:NAME=VALUE`` settings of the tree ``label``."""
    env = {}
    for text in settings:
        tree, sep, assignment = text.partition(":")
        name, eq, value = assignment.partition("=")
        if not sep or not eq or not name:
            raise SystemExit(f"--tree-env {text!r}: expected LABEL:NAME=VALUE")
        if tree == label:
            env[name] = value
    return env


def positive(kind):
    def parse(text: str):
        try:
            x = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
        if x <= 0:
            raise argparse.ArgumentTypeError(f"must be > 0, got {text!r}")
        return x
    return parse


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--dirs", nargs="+", type=labelled("--dirs"), required=True,
                   metavar="LABEL=DIR", help="media: a directory each (made if missing)")
    p.add_argument("--pages", nargs="+", type=parse_size,
                   default=[64 * KiB, 256 * KiB, 2 * MiB], metavar="SIZE",
                   help="page sizes (default 64KiB 256KiB 2MiB)")
    p.add_argument("--ops", nargs="+", choices=list(OPS), default=list(OPS),
                   help="restore (read job), spill (write job)")
    p.add_argument("--threads", nargs="+", type=positive(int), default=[1, 4, 16],
                   help="numjobs: threads issuing calls on one tier (default 1 4 16)")
    p.add_argument("--runtime", type=positive(float), default=1.5,
                   help="timed seconds of each engine in each cell (default 1.5)")
    p.add_argument("--ramp", type=float, default=0.2,
                   help="seconds run before counting (default 0.2)")
    p.add_argument("--pages-per-thread", type=positive(int), default=None,
                   help="pages each thread cycles over (default: 64, at most 32 MiB)")
    p.add_argument("--backend", choices=("auto", "posix", "kvikio", "nixl"), default="auto",
                   help="gdskv backend, raw's too (auto: kvikio on a GPU, posix otherwise)")
    p.add_argument("--mem", choices=("gpu", "host"), default=None,
                   help="the KV pool (default: gpu where CUDA is usable)")
    p.add_argument("--raw-io", choices=("pool", "caller"), default="pool",
                   help="raw's calls through the backend's threads (pool, what --compare "
                        "compares with) or on the calling thread (caller)")
    p.add_argument("--rounds", type=positive(int), default=1,
                   help="gdskv-bench --compare-rounds (ABBA within each cell; default 1)")
    p.add_argument("--tree", action="append", type=labelled("--tree"), default=None,
                   metavar="LABEL=DIR",
                   help="source tree to run gdskv-bench from; repeat for before/after "
                        "(default: this checkout, labelled 'this')")
    p.add_argument("--tree-env", action="append", default=[], metavar="LABEL:NAME=VALUE",
                   help="an environment variable for one tree's processes, e.g. "
                        "off:GDSKV_COMBINE_CALLS=false (the same tree twice, one setting apart)")
    p.add_argument("--with-hicachefile", action="store_true",
                   help="let --compare run SGLang's HiCacheFile too where sglang imports "
                        "(default: gdskv and raw only)")
    p.add_argument("--python", default=sys.executable, help="interpreter for gdskv-bench")
    p.add_argument("--timeout", type=positive(float), default=400.0,
                   help="seconds one gdskv-bench process may take (default 400)")
    p.add_argument("--out", required=True, help="the matrix's JSON")
    p.add_argument("--log-dir", default=None,
                   help="each process's job file, JSON and stderr (default: OUT's name + -logs)")
    p.add_argument("--dry-run", action="store_true",
                   help="print the plan and a rough wall-time estimate, run nothing")
    return p


def pages_per_thread(page_bytes: int, asked: int | None) -> int:
    return asked or max(1, min(64, 32 * MiB // page_bytes))


def job_file(args, directory: str, page_bytes: int) -> tuple[str, list[tuple[str, str, int]]]:
    """A group's fio-style job file and its jobs (name, op, threads)."""
    layers, tokens = geometry(page_bytes)
    lines = ["[global]", "model=llama3-8b", f"layers={layers}", f"page_tokens={tokens}",
             f"directory={directory}", f"backend={args.backend}",
             f"bs={page_bytes}",
             f"size={page_bytes * pages_per_thread(page_bytes, args.pages_per_thread)}",
             "time_based", f"runtime={args.runtime}", f"ramp_time={args.ramp}",
             "group_reporting", "unlink", f"raw_io={args.raw_io}"]
    if args.mem:
        lines.append(f"mem={args.mem}")
    jobs = []
    for op in args.ops:
        for n in args.threads:
            name = f"{op}-t{n}"
            jobs.append((name, op, n))
            lines += ["", f"[{name}]", f"rw={OPS[op]}", f"numjobs={n}"]
    return "\n".join(lines) + "\n", jobs


def check_imports(stderr: str, tree: str) -> dict:
    """tree_bench's first line: the files imported, which must be the tree's own."""
    for line in stderr.splitlines():
        if line.startswith("tree_bench: {"):
            info = json.loads(line[len("tree_bench: "):])
            root = os.path.realpath(tree) + os.sep
            wrong = [k for k in ("gdskv", "bench", "kernels")
                     if not os.path.realpath(info.get(k) or "").startswith(root)]
            if wrong:
                raise RuntimeError(f"tree {tree}: {', '.join(wrong)} imported from elsewhere: "
                                   f"{info}")
            return info
    raise RuntimeError(f"tree {tree}: tree_bench did not say what it imported; stderr ends: "
                       f"{stderr[-600:]!r}")


def _engine_jobs(doc: dict, name: str, engine: str) -> list[dict]:
    """An engine's job entries of one cell (one a round: NAME.ENGINE or NAME.ENGINE.rN)."""
    stem = f"{name}.{engine}"
    return [j for j in doc.get("jobs", [])
            if j.get("jobname") == stem or j.get("jobname", "").startswith(stem + ".r")]


def empty_cell(op: str, threads: int, page_bytes: int, error: str | None = None) -> dict:
    return {"op": op, "threads": threads, "page_bytes": page_bytes, "engines": {},
            "ratio_aggregate": None, "ratio_p50": None, "ratio_p99": None,
            "errors": [error] if error else []}


def cells_of(doc: dict, jobs, page_bytes: int) -> list[dict]:
    """The cells of one gdskv-bench JSON: each engine's figures and gdskv/raw of them."""
    compare = {c["job"]: c for c in doc.get("gdskv_compare", [])}
    out = []
    for name, op, threads in jobs:
        direction = OPS[op]
        cell = empty_cell(op, threads, page_bytes)
        c = compare.get(name)
        if c is None:
            cell["errors"].append(f"no comparison for job {name!r} in gdskv-bench's JSON")
            out.append(cell)
            continue
        bws, clats = c["bw_bytes"].get(direction, {}), c.get("clat_ns", {}).get(direction, {})
        for engine, bw in bws.items():
            ejobs = _engine_jobs(doc, name, engine)
            g = ejobs[0]["gdskv"] if ejobs else {}
            if g.get("page_bytes") not in (None, page_bytes):
                cell["errors"].append(f"{engine}: page_bytes {g['page_bytes']} != {page_bytes}")
            for j in ejobs:
                if j.get("error"):
                    cell["errors"].append(f"{j['jobname']}: error={j['error']}"
                                          + (f" ({j['gdskv']['failed']})"
                                             if j["gdskv"].get("failed") else ""))
            cell["engines"][engine] = {
                "pages_per_s": bw / page_bytes, "bw_bytes": bw,
                "calls": sum(j[direction]["total_ios"] for j in ejobs),
                "clat_p50_ns": clats.get(engine, {}).get("p50"),
                "clat_p99_ns": clats.get(engine, {}).get("p99"),
                "backend": g.get("backend"), "compat_mode": g.get("compat_mode"),
                "mem": g.get("mem"), "o_direct": g.get("o_direct"),
                "page_engine": g.get("page_engine")}
        r = c.get("ratios", {})
        cell["ratio_aggregate"] = r.get(f"{direction}: gdskv/raw")
        cell["ratio_p50"] = r.get(f"{direction}: clat p50 gdskv/raw")
        cell["ratio_p99"] = r.get(f"{direction}: clat p99 gdskv/raw")
        if "ratios_by_round" in c:
            cell["ratio_aggregate_by_round"] = [x.get(f"{direction}: gdskv/raw")
                                                for x in c["ratios_by_round"]]
        out.append(cell)
    return out


def tree_commit(tree: str) -> str | None:
    if not os.path.exists(os.path.join(tree, ".git")):
        return None
    r = subprocess.run(["git", "-C", tree, "rev-parse", "--short", "HEAD"],
                       capture_output=True, text=True)
    dirty = subprocess.run(["git", "-C", tree, "status", "--porcelain", "--untracked-files=no"],
                           capture_output=True, text=True).stdout.strip()
    return (r.stdout.strip() + ("+changes" if dirty else "")) if r.returncode == 0 else None


def run_group(args, tree_label: str, tree: str, medium: str, directory: str, page_bytes: int,
              log_dir: str) -> tuple[dict, list[dict], dict | None]:
    """One gdskv-bench process: a tree, a medium, a page size. (group record, cells, imports)"""
    stem = f"{tree_label}_{medium}_{page_bytes // KiB}KiB".replace("/", "_")
    text, jobs = job_file(args, directory, page_bytes)
    ini = os.path.join(log_dir, stem + ".ini")
    out_json = os.path.join(log_dir, stem + ".json")
    err_path = os.path.join(log_dir, stem + ".stderr")
    with open(ini, "w") as f:
        f.write(text)
    if os.path.exists(out_json):
        os.unlink(out_json)
    cmd = [args.python, TREE_BENCH] + ([] if args.with_hicachefile else ["--no-hicachefile"]) \
        + [tree, "--compare=1", f"--compare-rounds={args.rounds}", "--output-format=json",
           f"--output={out_json}", ini]
    before = set(os.listdir(directory))
    t0 = time.monotonic()
    group = {"tree": tree_label, "medium": medium, "page_bytes": page_bytes, "json": out_json,
             "stderr": err_path, "rc": None, "wall_s": None, "error": None}
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=args.timeout,
                              env=dict(os.environ, PYTHONUNBUFFERED="1",
                                       **tree_env(args.tree_env, tree_label)))
        rc, stderr = proc.returncode, proc.stderr + proc.stdout
    except subprocess.TimeoutExpired as exc:  # killed; what it wrote so far comes as bytes
        rc, stderr = None, (exc.stderr or b"").decode(errors="replace")
        group["error"] = f"timed out after {args.timeout:.0f} s"
    group["rc"], group["wall_s"] = rc, round(time.monotonic() - t0, 2)
    # a process killed or failed mid-job leaves its stores (unlink runs at a job's end): on
    # /dev/shm they would hold memory for the rest of the run
    for name in set(os.listdir(directory)) - before:
        if name.startswith("gdskv-bench-"):
            shutil.rmtree(os.path.join(directory, name), ignore_errors=True)
    with open(err_path, "w") as f:
        f.write(stderr)
    try:
        imports = check_imports(stderr, tree)
    except RuntimeError as exc:  # the wrong tree ran, or none: its numbers are not this tree's
        group["error"], imports = str(exc), None
        return group, [], None
    cells = []
    if os.path.exists(out_json) and os.path.getsize(out_json):
        with open(out_json) as f:
            cells = cells_of(json.load(f), jobs, page_bytes)
    elif group["error"] is None:
        last = (stderr.strip().splitlines() or [""])[-1][:300]
        group["error"] = f"gdskv-bench exited {rc} without its JSON: {last} (all: {err_path})"
    if group["error"]:
        cells = [empty_cell(op, n, page_bytes, group["error"]) for _, op, n in jobs]
    for c in cells:
        c.update(tree=tree_label, medium=medium, directory=directory,
                 pages_per_thread=pages_per_thread(page_bytes, args.pages_per_thread))
    return group, cells, imports


# -- report -------------------------------------------------------------------------------------

def _ratio(x) -> str:
    return "–" if x is None else f"{x:.2f}"


def _rate(x) -> str:
    if x is None:
        return "–"
    return f"{x / 1000:.1f}k" if x >= 1000 else f"{x:.0f}"


def _rates(cell: dict) -> str:
    """``2.2k:24k``: gdskv's and raw's aggregate pages/s."""
    return ":".join(_rate(cell["engines"].get(e, {}).get("pages_per_s")) for e in ("gdskv", "raw"))


#: the table's columns after medium, page and op: one figure a thread count in each
COLUMNS = (lambda c: _ratio(c["ratio_aggregate"]), _rates, lambda c: _ratio(c["ratio_p50"]),
           lambda c: _ratio(c["ratio_p99"]))


def markdown(result: dict) -> str:
    """A table a tree: rows medium x page x op, the thread counts side by side in each column."""
    threads = result["settings"]["threads"]
    tcols = " / ".join(map(str, threads))
    parts = []
    for label, info in result["trees"].items():
        cells = [c for c in result["cells"] if c["tree"] == label]
        engines = sorted({(e.get("page_engine") or "not reported", e.get("backend"),
                           e.get("mem"))
                          for c in cells for k, e in c["engines"].items() if k == "gdskv"},
                         key=str)
        desc = "; ".join(f"page engine {p}, backend {b}, mem {m}" for p, b, m in engines)
        parts += [f"tree {label} ({info.get('commit') or info['dir']}; {desc or 'no results'})",
                  "",
                  f"| medium | page | op | aggregate gdskv/raw, threads {tcols} "
                  f"| pages/s gdskv:raw | p50 gdskv/raw | p99 gdskv/raw |",
                  "|---|---|---|---|---|---|---|"]
        rows: dict = {}
        for c in cells:
            rows.setdefault((c["medium"], c["page_bytes"], c["op"]), {})[c["threads"]] = c
        for (medium, page, op), by_t in rows.items():
            row = [by_t.get(t) for t in threads]
            cols = [" / ".join("–" if c is None else fn(c) for c in row) for fn in COLUMNS]
            parts.append(f"| {medium} | {size_label(page)} | {op} | " + " | ".join(cols) + " |")
        errors = [f"{c['medium']} {size_label(c['page_bytes'])} {c['op']} t{c['threads']}: "
                  f"{c['errors'][0]}" for c in cells if c["errors"]]
        if errors:
            parts += ["", f"{len(errors)} cell(s) with errors, first: {errors[0][:300]}"]
        parts.append("")
    return "\n".join(parts)


def estimate_s(args) -> float:
    """A rough wall time: process starts plus each engine's timed phase and set-up."""
    groups = len(args.dirs) * len(args.pages) * len(args.tree)
    engine_runs = len(args.ops) * len(args.threads) * 2 * args.rounds
    return groups * (START_S + engine_runs * (args.ramp + args.runtime + ENGINE_S))


def write_json(path: str, result: dict) -> None:
    tmp = path + ".part"
    with open(tmp, "w") as f:
        json.dump(result, f, indent=1)
    os.replace(tmp, path)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    args.tree = args.tree or [("this", REPO)]
    labels = {label for label, _ in args.tree}
    for text in args.tree_env:  # a setting for no tree would silently measure nothing
        if text.partition(":")[0] not in labels:
            raise SystemExit(f"--tree-env {text!r}: no --tree is labelled "
                             f"{text.partition(':')[0]!r} (trees: {', '.join(sorted(labels))}); "
                             "name the same tree twice, e.g. --tree a=. --tree b=.")
    for label, tree in args.tree:
        if not os.path.isfile(os.path.join(tree, "bench", "cli.py")):
            raise SystemExit(f"--tree {label}={tree}: not a gdskv source tree (no bench/cli.py)")
    log_dir = args.log_dir or os.path.splitext(args.out)[0] + "-logs"
    groups = [(m, d, p) for m, d in args.dirs for p in args.pages]
    print(f"concurrency_matrix: {len(groups) * len(args.tree)} gdskv-bench processes, "
          f"{len(groups) * len(args.ops) * len(args.threads)} cells a tree, about "
          f"{estimate_s(args) / 60:.1f} min (a rough guess)", flush=True)
    if args.dry_run:
        return 0
    os.makedirs(log_dir, exist_ok=True)
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    for _, d in args.dirs:
        os.makedirs(d, exist_ok=True)
    result = {"schema": "gdskv concurrency_matrix 1", "host": socket.gethostname(),
              "started": datetime.datetime.now().isoformat(timespec="seconds"),
              "settings": {k: v for k, v in vars(args).items() if k not in ("tree", "dirs")},
              "media": dict(args.dirs),
              "trees": {label: {"dir": os.path.realpath(t), "commit": tree_commit(t)}
                        for label, t in args.tree},
              "groups": [], "cells": []}
    t_all = time.monotonic()
    for i, (medium, directory, page) in enumerate(groups):
        order = args.tree if i % 2 == 0 else args.tree[::-1]
        for label, tree in order:
            group, cells, imports = run_group(args, label, tree, medium, directory, page, log_dir)
            result["groups"].append(group)
            result["cells"] += cells
            result["wall_s"] = round(time.monotonic() - t_all, 1)
            first = imports is not None and "imports" not in result["trees"][label]
            if first:
                result["trees"][label]["imports"] = imports
            write_json(args.out, result)  # after every group: a later failure keeps these
            if imports is None:
                raise SystemExit(f"tree {label} ({tree}): {group['error']}")
            if first:
                print(f"tree {label}: gdskv {imports['gdskv']}; native {imports['native']}",
                      flush=True)
            bad = sum(bool(c["errors"]) for c in cells)
            print(f"  {label} {medium} {size_label(page)}: {group['wall_s']:.0f} s, "
                  f"rc {group['rc']}" + (f", {bad} cell(s) with errors" if bad else ""),
                  flush=True)
    print()
    print(markdown(result))
    print(f"wall {result['wall_s']:.0f} s; JSON {args.out}; logs {log_dir}")
    return 1 if any(c["errors"] for c in result["cells"]) else 0


if __name__ == "__main__":
    sys.exit(main())
