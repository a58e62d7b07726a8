"""The store's fault table: pages still served (and wrong bytes served) after one fault per trial.

Each trial makes a fresh 64-page store (64 slots, 4 KiB each, in 2 slab files; pages put 8 at
a time, so the journal holds one COMMIT record per page), closes it, applies one fault, opens
it again and reads every page back, comparing each hit with the bytes that were put. Fault
classes (one fault per trial, drawn from a seeded RNG):

- ``slab-bit``: 1 bit flipped in a random page's payload in its slab file
- ``slab-zero``: one 4 KiB block of a slab file zeroed (a random written slot)
- ``journal-bit``: 1 bit flipped anywhere in the journal
- ``journal-cut``: the journal truncated at a random byte
- ``journal-gone``: the journal deleted
- ``manifest-bit``: 1 bit flipped anywhere in the manifest (refused to open counts 0 served)

    python bench/experiments/fault_table.py [--trials 6] [--seed 1] [--json] [--dir DIR]

tests/test_fault_table.py runs it and holds it to the targets of issue 15.

Results it produced: ``cpu-2026-11-23/fault-table/`` (before.json on main 0f8bdfe,
after_journal_skip.json, after_header_scan.json), tabled in bench/RESULTS.md.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import random
import tempfile

import torch

from gdskv.config import TierConfig
from gdskv.layout import KVLayout
from gdskv.store import JOURNAL, MANIFEST, StoreError
from gdskv.tier import Tier

#: 4 layers x 4 tokens x 48-wide rows: 3072 B pages in 4096 B slots
LAYOUT = KVLayout(num_layers=4, page_size=4, head_dim=48)
PAGES = 64
FAULTS = ("slab-bit", "slab-zero", "journal-bit", "journal-cut", "journal-gone", "manifest-bit")


def config(directory: str) -> TierConfig:
    slot = LAYOUT.slot_bytes
    return TierConfig(directories=(directory,), capacity=PAGES * slot, io_chunk_size=4 * slot,
                      staging_size=8 * slot, files_per_dir=2, io_threads=2)


def content(key: str) -> torch.Tensor:
    """The payload put under ``key`` (deterministic: recomputed to check what is read)."""
    seed = int.from_bytes(hashlib.blake2b(key.encode(), digest_size=7).digest(), "little")
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (LAYOUT.page_bytes,), dtype=torch.uint8, generator=gen)


def _flip_bit(path: str, rng: random.Random, start: int = 0, end: int | None = None) -> None:
    size = os.path.getsize(path)
    offset = rng.randrange(start, size if end is None else end)
    with open(path, "r+b") as f:
        f.seek(offset)
        byte = f.read(1)[0]
        f.seek(offset)
        f.write(bytes([byte ^ (1 << rng.randrange(8))]))


def _apply(fault: str, directory: str, where: dict[str, tuple[str, int]],
           rng: random.Random) -> None:
    journal, manifest = os.path.join(directory, JOURNAL), os.path.join(directory, MANIFEST)
    if fault in ("slab-bit", "slab-zero"):
        path, off = where[rng.choice(sorted(where))]
        if fault == "slab-bit":
            _flip_bit(path, rng, off, off + LAYOUT.page_bytes)
        else:
            with open(path, "r+b") as f:
                f.seek(off)
                f.write(bytes(4096))
    elif fault == "journal-bit":
        _flip_bit(journal, rng)
    elif fault == "journal-cut":
        os.truncate(journal, rng.randrange(os.path.getsize(journal)))
    elif fault == "journal-gone":
        os.unlink(journal)
    elif fault == "manifest-bit":
        _flip_bit(manifest, rng)
    else:
        raise ValueError(f"unknown fault {fault!r}; one of {', '.join(FAULTS)}")


def trial(fault: str, directory: str, rng: random.Random) -> dict:
    """One store, one fault: {"served", "wrong", "refused"} (refused: the error text)."""
    keys = [f"page-{n}" for n in range(PAGES)]
    cfg = config(directory)
    with Tier(LAYOUT, cfg, device="cpu") as tier:
        for i in range(0, PAGES, 8):
            batch = keys[i:i + 8]
            assert all(tier.put_pages(batch, [[content(k)] for k in batch]))
        where = {}
        for k in keys:
            f, off = tier.store.location(tier.directory._index[k])
            where[k] = (tier.store.files[f].path, off)
    _apply(fault, directory, where, rng)
    try:
        tier = Tier(LAYOUT, cfg, device="cpu")
    except StoreError as exc:
        return {"served": 0, "wrong": 0, "refused": str(exc)}
    with tier:
        out = [torch.zeros(LAYOUT.page_bytes, dtype=torch.uint8) for _ in keys]
        hits = tier.get_pages(keys, [[o] for o in out])
    wrong = sum(1 for k, h, o in zip(keys, hits, out) if h and not torch.equal(o, content(k)))
    return {"served": sum(hits), "wrong": wrong, "refused": ""}


def run(faults=FAULTS, trials: int = 6, seed: int = 1, parent: str | None = None) -> dict:
    """{fault: {"served", "total", "wrong", "refused", "per_trial"}} over ``trials`` each."""
    table = {}
    for fault in faults:
        rng = random.Random(f"{seed}:{fault}")
        rows = []
        for _ in range(trials):
            with tempfile.TemporaryDirectory(dir=parent) as d:
                os.chmod(d, 0o700)
                rows.append(trial(fault, d, rng))
        table[fault] = {"served": sum(r["served"] for r in rows), "total": trials * PAGES,
                        "wrong": sum(r["wrong"] for r in rows),
                        "refused": sum(bool(r["refused"]) for r in rows),
                        "per_trial": [r["served"] for r in rows]}
    return table


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--trials", type=int, default=6)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--dir", default=None, help="parent of the trial stores (default: $TMPDIR)")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    table = run(trials=args.trials, seed=args.seed, parent=args.dir)
    if args.json:
        print(json.dumps(table, indent=1))
        return
    print(f"| fault | pages still served | wrong bytes | refused to open |\n|---|---|---|---|")
    for fault, row in table.items():
        print(f"| {fault} | {row['served']}/{row['total']} | {row['wrong']} | "
              f"{row['refused']}/{len(row['per_trial'])} |")


if __name__ == "__main__":
    main()
