"""``gdskv``: look into, check, repair and maintain a store from the shell.

    gdskv info DIR...                 what the store is and holds
    gdskv ls DIR... [--limit N]       the stored pages (key, slot, checksum)
    gdskv verify DIR... [--sample N] [--repair]
                                      read and checksum every page (or N of them); exit 1 if any
                                      is bad; --repair drops the bad ones
    gdskv rebuild DIR...              header scan: rebuild the directory from the slot trailers
    gdskv compact DIR...              rewrite the journal to one record per page
    gdskv clear DIR... [--yes]        drop every page (asks first unless --yes)
    gdskv cluster list DIR...         the nodes' namespaces of a cluster store (DIR: the shared
                                      directories) and whether each one's writer runs
    gdskv cluster reclaim NODE DIR... [--yes]
                                      remove a node's namespace (refused while its writer runs)

Every subcommand takes ``--json``. A store is named by its directories (all of them, in the
order it was made with); its layout and geometry come from its manifest. ``info``, ``ls`` and
``verify`` without ``--repair`` open it read-only (no lock; beside a running writer, as a
follower); the others take the writer's lock and refuse a store another process holds. Exit
status: 0 done, 1 verify found bad pages, 2 bad input or a store that cannot be opened as asked
(one ``gdskv: error: ...`` line; nothing changed).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import time
from collections.abc import Sequence
from importlib.metadata import PackageNotFoundError, version

from . import checksum, namespaces
from .config import ConfigError, TierConfig, check_node_id
from .layout import BytePageLayout, KVLayout, PageLayout
from .store import (JOURNAL, LOCK, MANIFEST, MANIFEST_COPY, StoreError, load_manifest,
                    manifest_geometry, open_regular)
from .tier import Tier


class UsageError(Exception):
    """Bad input: printed as one ``gdskv: error:`` line, exit 2."""


def _version() -> str:
    try:
        return version("gdskv")
    except PackageNotFoundError:
        return "unknown"


# -- opening a store from its manifest -------------------------------------------------------
def _check_dirs(directories: Sequence[str]) -> None:
    for d in directories:
        if not os.path.exists(d):
            raise UsageError(f"store directory {d!r} does not exist")
        if not os.path.isdir(d):
            raise UsageError(f"{d!r} is not a directory: name the store's directory")


def _manifest(directories: Sequence[str]) -> dict:
    _check_dirs(directories)
    first = directories[0]
    for name in (MANIFEST, MANIFEST_COPY):
        path = os.path.join(first, name)
        if os.path.lexists(path):
            try:
                return load_manifest(path)
            except StoreError:
                continue  # the copy, or the store's own open reports both damaged
    raise UsageError(f"no gdskv store in {first!r} (no {MANIFEST}): name a store directory"
                     + _stores_below(first))


def _stores_below(directory: str, shown: int = 5) -> str:
    """``; stores in its subdirectories: ...``: gdskv-bench (and the adapters) make a store
    in a subdirectory of the directory they were given, the one a user tends to name."""
    try:
        below = sorted(e.path for e in os.scandir(directory)
                       if e.is_dir() and os.path.exists(os.path.join(e.path, MANIFEST)))
    except OSError:
        return ""
    if not below:
        return ""
    more = f" and {len(below) - shown} more" if len(below) > shown else ""
    return f"; stores in its subdirectories: {' '.join(below[:shown])}{more}"


def _layout(manifest: dict) -> PageLayout:
    fields = manifest.get("layout")
    if not isinstance(fields, dict):
        raise UsageError("the store manifest has no layout; it is not a gdskv store of this "
                         f"version (format {manifest.get('format_version')!r})")
    cls = BytePageLayout if "kind" in fields else KVLayout
    try:
        return cls(**fields)
    except (TypeError, ValueError) as exc:
        raise UsageError(f"the store manifest's layout is not one this gdskv reads: {exc}") \
            from None


def _config(directories: Sequence[str], manifest: dict, *, read_only: bool) -> TierConfig:
    """The TierConfig that reopens this store's geometry (from its manifest)."""
    try:
        geometry = manifest_geometry(manifest, len(directories))
    except StoreError as exc:
        raise UsageError(str(exc)) from None
    return TierConfig(directories=tuple(directories), **geometry,
                      staging_size=max(4 * int(manifest["slot_bytes"]), 16 << 20),
                      pipeline_depth=2, io_threads=4, backend="posix", read_only=read_only,
                      preallocate=False)


def open_store(directories: Sequence[str], *, read_only: bool, scan_headers: bool = False,
               scan_progress=None) -> Tier:
    manifest = _manifest(directories)
    return Tier(_layout(manifest), _config(directories, manifest, read_only=read_only),
                device="cpu", scan_headers=scan_headers, scan_progress=scan_progress)


# -- progress (rich, on a terminal only) -----------------------------------------------------
class _Progress:
    def __init__(self, label: str, total: int, enabled: bool) -> None:
        self._bar = None
        if enabled and sys.stderr.isatty():
            try:
                from rich.console import Console
                from rich.progress import Progress
            except ImportError:  # rich is optional (the bench extra): no bar without it
                return
            self._bar = Progress(console=Console(file=sys.stderr), transient=True)
            self._bar.start()
            self._task = self._bar.add_task(label, total=total)

    def advance(self, n: int) -> None:
        if self._bar is not None:
            self._bar.advance(self._task, n)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.stop()


# -- subcommands -----------------------------------------------------------------------------
def _lock_holder(directory: str) -> int | None:
    """pid holding one of the store's writer locks now (gdskv.lock or a slab file, which a
    writer keeps locked too; this host only), None if nobody."""
    pids: set[int] = set()
    try:
        for name in os.listdir(directory):
            if name == LOCK or name.startswith("slab-"):
                pids |= namespaces.lock_holders(os.stat(os.path.join(directory, name)))
    except OSError:
        return None
    return min(pids) if pids else None


def cmd_info(args) -> tuple[dict, int]:
    manifest = _manifest(args.directories)
    with open_store(args.directories, read_only=True) as tier:
        st = tier.stats()
        store = tier.store
        files = [{"path": f.path, "bytes": os.path.getsize(f.path)} for f in store.files]
    journal = os.path.join(store.directories[0], JOURNAL)
    jst = os.stat(journal) if os.path.exists(journal) else None
    holder = _lock_holder(store.directories[0])
    out = {"format_version": manifest.get("format_version"), "store_id": manifest.get("store_id"),
           "fingerprint": manifest.get("fingerprint"), "layout": manifest.get("layout"),
           "slot_bytes": store.slot_bytes, "page_bytes": tier.layout.page_bytes,
           "capacity_pages": store.num_slots, "capacity_bytes": store.num_slots * store.slot_bytes,
           "pages": st["pages_stored"], "bytes": st["bytes_stored"],
           "slab_files": files, "journal_bytes": jst.st_size if jst else None,
           "o_direct": st["o_direct"], "o_direct_reason": st["o_direct_reason"],
           "writer_pid": holder,
           "last_write": time.strftime("%Y-%m-%dT%H:%M:%S%z", time.localtime(jst.st_mtime))
           if jst else None,
           "followers_view": {"pages": st["pages_stored"], "as_of": "now (read-only open)"}}
    return out, 0


def cmd_ls(args) -> tuple[dict, int]:
    with open_store(args.directories, read_only=True) as tier:
        entries = tier.directory.ready_entries()
    shown = entries if args.limit is None else entries[:args.limit]
    return {"pages": len(entries), "shown": [
        {"key": k if isinstance(k, str) else k.hex(), "key_type": type(k).__name__,
         "slot": s, "checksum": f"{c:016x}", "algorithm": a} for k, s, c, a in shown]}, 0


def _read_slot(tier: Tier, slot: int) -> bytes:
    f, off = tier.store.location(slot)
    fd = open_regular(tier.store.files[f].path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        return os.pread(fd, tier.layout.page_bytes, off)
    finally:
        os.close(fd)


def _bad_pages(tier: Tier, entries, progress: _Progress) -> list[dict]:
    """The entries whose payload does not read back whole with its checksum."""
    import torch
    verifiers: dict[int, object] = {}
    bad = []
    for key, slot, want, algo in entries:
        try:
            data = _read_slot(tier, slot)
            why = "short read" if len(data) < tier.layout.page_bytes else None
        except OSError as exc:
            data, why = b"", f"read failed: {exc.strerror}"
        if why is None:
            if algo not in verifiers:
                verifiers[algo] = checksum.checksummer(algo, tier.layout)
            buf = torch.zeros(tier.layout.slot_bytes, dtype=torch.uint8)
            buf[:len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
            if int(verifiers[algo].compute(buf, 1)[0]) != want:
                why = "checksum mismatch"
        if why is not None:
            bad.append({"key": key, "slot": slot, "why": why})
        progress.advance(1)
    return bad


def cmd_verify(args) -> tuple[dict, int]:
    with open_store(args.directories, read_only=not args.repair) as tier:
        entries = tier.directory.ready_entries()
        if args.sample is not None and args.sample < len(entries):
            entries = random.Random(args.seed).sample(entries, args.sample)
        progress = _Progress("verifying", len(entries), not args.json)
        try:
            bad = _bad_pages(tier, entries, progress)
        finally:
            progress.close()
        if bad and not args.repair:
            # beside a writer: a page it evicted or rewrote meanwhile is not damage; check
            # again the ones its journal still maps to the same slot and checksum
            tier.refresh()
            now = {(k, s, c) for k, s, c, _ in tier.directory.ready_entries()}
            suspects = {(b["key"], b["slot"]) for b in bad}
            bad = _bad_pages(tier, [e for e in entries if (e[0], e[1]) in suspects
                                    and (e[0], e[1], e[2]) in now], _Progress("", 0, False))
        dropped = tier.evict([b["key"] for b in bad]) if args.repair and bad else 0
    for b in bad:
        b["key"] = b["key"] if isinstance(b["key"], str) else b["key"].hex()
    return {"checked": len(entries), "bad": bad, "dropped": dropped}, 1 if bad else 0


def cmd_rebuild(args) -> tuple[dict, int]:
    manifest = _manifest(args.directories)
    progress = _Progress("scanning slot trailers", int(manifest.get("num_slots", 0)),
                         not args.json)
    try:
        with open_store(args.directories, read_only=False, scan_headers=True,
                        scan_progress=progress.advance) as tier:
            st = tier.stats()
    finally:
        progress.close()
    return {"pages": st["pages_stored"], "from_trailers": st.get("header_scan_pages", 0),
            "scan_seconds": round(st.get("header_scan_seconds", 0.0), 3)}, 0


def cmd_compact(args) -> tuple[dict, int]:
    journal = os.path.join(args.directories[0], JOURNAL)
    with open_store(args.directories, read_only=False) as tier:
        before = os.path.getsize(journal)
        tier.compact()
        pages = len(tier.directory)
    return {"pages": pages, "journal_bytes_before": before,
            "journal_bytes_after": os.path.getsize(journal)}, 0


def cmd_clear(args) -> tuple[dict, int]:
    manifest = _manifest(args.directories)
    _confirm(args, "clear", "drops every page", f"drop every page of the store in "
             f"{', '.join(args.directories)} ({manifest.get('fingerprint')})")
    with open_store(args.directories, read_only=False) as tier:
        pages = len(tier.directory)
        tier.clear()
        tier.compact()
    return {"dropped": pages}, 0


# -- cluster stores (gdskv.cluster): one namespace per node under the shared directories ---
def _confirm(args, what: str, effect: str, question: str) -> None:
    """Ask on a terminal before ``what`` (the subcommand) destroys data, unless --yes."""
    if args.yes:
        return
    if not sys.stdin.isatty():
        raise UsageError(f"{what} {effect}: pass --yes (no terminal to ask on)")
    if input(f"{question}? type yes: ").strip() != "yes":
        raise UsageError(f"{what} not confirmed: nothing changed")


def cmd_cluster_list(args) -> tuple[dict, int]:
    roots = args.directories
    _check_dirs(roots)
    try:
        names, ignored = namespaces.list_namespaces(roots)
    except OSError as exc:
        raise UsageError(f"cannot list the cluster in {', '.join(roots)}: {exc}") from None
    try:
        running: dict = namespaces.writers_running(roots, names)
        unknown = None
    except OSError as exc:  # writers kept starting, or a read-only mount: list the rest
        running, unknown = {}, f"whether each writer runs is not known: {exc}"
    nodes = []
    for name in names:
        dirs = [os.path.join(r, name) for r in roots]
        entry = {"node": name, "writer_running": running.get(name)}
        try:
            info, _ = cmd_info(argparse.Namespace(directories=dirs))
        except (UsageError, ConfigError, OSError) as exc:  # OSError: e.g. reclaimed meanwhile
            entry["store"] = f"none readable ({exc})"
        else:
            entry.update({k: info[k] for k in ("pages", "bytes", "capacity_bytes",
                                               "fingerprint", "last_write", "writer_pid")})
        nodes.append(entry)
    out = {"directories": list(roots), "nodes": nodes, "ignored": ignored}
    if unknown:
        out["writers_unknown"] = unknown
    return out, 0


def cmd_cluster_reclaim(args) -> tuple[dict, int]:
    roots = args.directories
    _check_dirs(roots)
    node = check_node_id(args.node)
    try:
        namespaces.check_reclaimable(roots, node)
        _confirm(args, "reclaim", "removes a node's pages", f"remove node {node!r}'s namespace "
                 f"and its pages ({', '.join(os.path.join(r, node) for r in roots)})")
        # checked again, under the start lock and the writer locks, before anything is removed
        return namespaces.reclaim(roots, node), 0
    except StoreError:
        raise
    except OSError as exc:
        raise UsageError(f"cannot reclaim node {node!r}: {exc}") from None


# -- the command line ------------------------------------------------------------------------
def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="gdskv", description="Look into, check, repair and "
                                 "maintain a gdskv store.")
    ap.add_argument("--version", action="version", version=f"gdskv {_version()}")
    sub = ap.add_subparsers(dest="command", required=True, metavar="COMMAND")

    def add(name: str, fn, help_: str) -> argparse.ArgumentParser:
        p = sub.add_parser(name, help=help_, description=help_)
        p.add_argument("directories", nargs="+", metavar="DIR",
                       help="the store's directories (all of them, in order)")
        p.add_argument("--json", action="store_true", help="print one JSON object")
        p.set_defaults(fn=fn)
        return p

    add("info", cmd_info, "what the store is and holds (read-only)")
    p = add("ls", cmd_ls, "list the stored pages (read-only)")
    p.add_argument("--limit", type=_count, default=None, help="show at most N pages")
    p = add("verify", cmd_verify, "read and checksum every page; exit 1 if any is bad")
    p.add_argument("--sample", type=_count, default=None, help="check N random pages only")
    p.add_argument("--seed", type=int, default=0, help="seed of the --sample draw")
    p.add_argument("--repair", action="store_true", help="drop the bad pages (takes the lock)")
    add("rebuild", cmd_rebuild, "rebuild the directory from the slot trailers (takes the lock)")
    add("compact", cmd_compact, "rewrite the journal to one record per page (takes the lock)")
    p = add("clear", cmd_clear, "drop every page (takes the lock; asks unless --yes)")
    p.add_argument("--yes", action="store_true", help="do not ask")
    cluster = sub.add_parser("cluster", help="the namespaces of a cluster store",
                             description="A cluster store's nodes (GDSKV_CLUSTER=true): one "
                             "namespace directory per node under each shared directory.")
    csub = cluster.add_subparsers(dest="cluster_command", required=True, metavar="COMMAND")
    for name, fn, help_ in (
            ("list", cmd_cluster_list, "each node's namespace: pages, capacity, last write, "
             "whether its writer runs"),
            ("reclaim", cmd_cluster_reclaim, "remove a node's namespace (refused while its "
             "writer runs; asks unless --yes)")):
        p = csub.add_parser(name, help=help_, description=help_)
        if name == "reclaim":
            p.add_argument("node", metavar="NODE", help="the node id (see gdskv cluster list)")
            p.add_argument("--yes", action="store_true", help="do not ask")
        p.add_argument("directories", nargs="+", metavar="DIR",
                       help="the cluster's shared directories (all of them, in order)")
        p.add_argument("--json", action="store_true", help="print one JSON object")
        p.set_defaults(fn=fn)
    return ap


def int_between(low: int, high: int | None, what: str):
    """An argparse type: a whole number in ``low..high`` (``high`` None: no upper bound);
    ``what`` names the kind of value in the error (shared with gdskv-bench's options)."""
    def parse(text: str) -> int:
        try:
            n = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not {what}") from None
        if n < low or (high is not None and n > high):
            raise argparse.ArgumentTypeError(
                f"{n} is not {what}: give {low}..{high}" if high is not None else
                f"{n} is below {low}: give {low} or more")
        return n
    parse.__name__ = what  # argparse names the type in some messages
    return parse


_count = int_between(0, None, "a whole number")


# -- what a person reads (--json prints the subcommand's dict as it is) ----------------------
def _iec(n: int) -> str:
    """1.5 MiB, 36 KiB, 512 B."""
    for unit, size in (("TiB", 1 << 40), ("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= size:
            return f"{n / size:.1f} {unit}".replace(".0 ", " ")
    return f"{n} B"


def _plain(value) -> str:
    """A value as a person writes it: yes/no, none, k=v lists, not Python's repr."""
    if isinstance(value, bool):
        return "yes" if value else "no"
    if value is None:
        return "none"
    if isinstance(value, dict):
        return ", ".join(f"{k}={_plain(v)}" for k, v in value.items())
    return str(value)


def _info_lines(out: dict, args) -> list[str]:
    files = out["slab_files"]
    journal = ("none" if out["journal_bytes"] is None else
               f"{_iec(out['journal_bytes'])}, last write {out['last_write']}")
    writer = ("no process on this host holds the store's lock" if out["writer_pid"] is None
              else f"pid {out['writer_pid']} holds the store's lock")
    return [f"store:       {' '.join(args.directories)}",
            f"format:      version {out['format_version']}, store id {out['store_id']}",
            f"fingerprint: {out['fingerprint']}",
            f"layout:      {_plain(out['layout'])}",
            f"pages:       {out['pages']} stored ({_iec(out['bytes'])}) of "
            f"{out['capacity_pages']} slots ({_iec(out['capacity_bytes'])}); page "
            f"{_iec(out['page_bytes'])}, slot {_iec(out['slot_bytes'])}",
            f"slab files:  {len(files)}, {_iec(sum(f['bytes'] for f in files))} on disk",
            *(f"  {f['path']}  {_iec(f['bytes'])}" for f in files),
            f"journal:     {journal}",
            f"O_DIRECT:    {_plain(out['o_direct'])} ({out['o_direct_reason']})",
            f"writer:      {writer}"]


def _verify_lines(out: dict, args) -> list[str]:
    bad = out["bad"]
    lines = [f"checked {out['checked']} pages: " + (f"{len(bad)} bad" if bad else "all good")]
    lines += [f"  key={b['key']}, slot={b['slot']}: {b['why']}" for b in bad]
    if bad:
        lines.append(f"dropped {out['dropped']} of them (--repair)" if args.repair else
                     "gdskv verify --repair drops them")
    return lines


_TEXT = {"info": _info_lines, "verify": _verify_lines}


def _print(out: dict, as_json: bool, args=None) -> None:
    if as_json:
        print(json.dumps(out, indent=1, default=str))
        return
    text = _TEXT.get(getattr(args, "command", None))
    if text is not None:
        print("\n".join(text(out, args)))
        return
    for k, v in out.items():
        if isinstance(v, list):
            print(f"{k}:")
            for item in v:
                print("  " + (", ".join(f"{a}={b}" for a, b in item.items())
                              if isinstance(item, dict) else str(item)))
        else:
            print(f"{k}: {v}")


def main(argv: Sequence[str] | None = None) -> int:
    ap = build_parser()
    args = ap.parse_args(argv)
    try:
        out, status = args.fn(args)
    except (UsageError, StoreError, ConfigError) as exc:
        ap.exit(2, f"gdskv: error: {exc}\n")
    _print(out, args.json, args)
    return status


def run() -> None:
    sys.exit(main())
