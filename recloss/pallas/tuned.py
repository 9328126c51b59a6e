"""Kernel block sizes measured on real chips, shipped with the package: `recloss-bench --tune` times the
Pallas kernels over candidate (sub-tile rows, vocab block) pairs on the chip it runs on and writes
``recloss/pallas/tuned/<chip>.json``; `recloss.pallas.tiling.choose` takes the entry for the chip it tiles
for (`blocks`), and keeps its heuristics where there is none.

A file holds the chip's name, how it was measured (device, jax, libtpu, date, command) and its entries:
one per (objective, sweep mode, table dtype, D) with the chosen ``bs`` and ``bv``, the time of each
candidate and of the heuristic's pick.
"""

from __future__ import annotations

import functools
import json
import math
from importlib import resources
from typing import Optional, Tuple


@functools.lru_cache(maxsize=None)
def table(chip: str) -> Optional[dict]:
    """The chip's measured table (the parsed ``tuned/<chip>.json``), or None when the package has none."""
    try:
        text = resources.files("recloss.pallas").joinpath("tuned", f"{chip}.json").read_text()
    except (FileNotFoundError, OSError):
        return None
    return json.loads(text)


def chips() -> Tuple[str, ...]:
    """The chips the package has measured tables for, e.g. ('v5e',)."""
    folder = resources.files("recloss.pallas").joinpath("tuned")
    if not folder.is_dir():
        return ()
    return tuple(sorted(p.name[:-5] for p in folder.iterdir() if p.name.endswith(".json")))


def blocks(chip: str, mode: tuple, dtype: str, d: int) -> Optional[Tuple[int, int]]:
    """(bs, bv) of the entry for ``mode`` = (objective, sweep mode) and the table's ``dtype`` on ``chip``
    whose D is nearest ``d`` (in ratio), or None (no table, or no entry for the mode and dtype)."""
    t = table(chip)
    if t is None:
        return None
    found = [e for e in t["entries"] if (e["objective"], e["mode"]) == tuple(mode) and e["dtype"] == dtype]
    if not found:
        return None
    best = min(found, key=lambda e: abs(math.log(e["d"] / max(d, 1))))
    return int(best["bs"]), int(best["bv"])
