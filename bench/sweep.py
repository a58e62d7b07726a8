"""Sweeps: one run per value of one option, one JSON per point, and a PNG of GB/s vs. the value.

The plot has one line per (engine, backend, direction), so gdskv, raw and hicachefile from a
``--compare`` sweep sit on the same axes.
"""

from __future__ import annotations

import json
import os
import re
from collections import defaultdict
from collections.abc import Iterable, Sequence
from typing import Any

SIZE_OPTIONS = {"bs", "size"}


def point_filename(key: str, text: str) -> str:
    safe = re.sub(r"[^A-Za-z0-9._-]+", "_", text)
    return f"sweep-{key}={safe}.json"


def write_point(sweep_dir: str, key: str, text: str, doc: dict[str, Any]) -> str:
    os.makedirs(sweep_dir, exist_ok=True)
    path = os.path.join(sweep_dir, point_filename(key, text))
    with open(path, "w", encoding="utf-8") as f:
        json.dump(doc, f, indent=2)
    return path


def series(points: Iterable[tuple[float, dict[str, Any]]]) -> dict[str, list[tuple[float, float]]]:
    """(x, fio-style JSON doc) points -> {label: [(x, GB/s), ...]} sorted by x."""
    lines: dict[str, list[tuple[float, float]]] = defaultdict(list)
    for x, doc in points:
        for job in doc.get("jobs", []):
            g = job.get("gdskv", {})
            for direction in ("write", "read"):
                bw = job.get(direction, {}).get("bw_bytes", 0)
                if not bw:
                    continue
                engine = g.get("engine", "?")
                backend = g.get("backend") or "?"
                label = engine if engine == "hicachefile" else f"{engine}/{backend}"
                lines[f"{label} {direction}"].append((x, bw / 1e9))
    return {k: sorted(v) for k, v in sorted(lines.items())}


def plot(lines: dict[str, Sequence[tuple[float, float]]], key: str, path: str,
         title: str = "") -> str:
    """Draw GB/s vs. the swept value to a PNG (matplotlib, no display needed)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 5), dpi=110)
    engines = sorted({label.rsplit(" ", 1)[0] for label in lines})
    colors = {e: f"C{i % 10}" for i, e in enumerate(engines)}  # one colour per engine/backend
    for label, pts in lines.items():
        xs, ys = zip(*pts)
        ax.plot(xs, ys, marker="o", color=colors[label.rsplit(" ", 1)[0]],
                linestyle="--" if label.endswith(" read") else "-", label=label)
    if key in SIZE_OPTIONS:
        ax.set_xscale("log", base=2)
        xs_all = sorted({x for pts in lines.values() for x, _ in pts})
        ax.set_xticks(xs_all)
        ax.set_xticklabels([_size_label(x) for x in xs_all])
    ax.set_xlabel(key.replace("_", "-") + (" (bytes per batch)" if key == "bs" else ""))
    ax.set_ylabel("GB/s (KV payload)")
    ax.set_title(title or f"gdskv-bench sweep over {key}")
    ax.grid(True, alpha=0.3)
    ax.set_ylim(bottom=0)
    if lines:
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return path


def _size_label(x: float) -> str:
    for unit, div in (("G", 1 << 30), ("M", 1 << 20), ("k", 1 << 10)):
        if x >= div and x % div == 0:
            return f"{int(x // div)}{unit}"
    return str(int(x))
