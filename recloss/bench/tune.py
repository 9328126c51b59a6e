"""recloss-bench --tune: the Pallas kernels' block sizes searched on the chip it runs on (a TPU only).

For each suite shape (`recloss.bench.chip.SHAPES`) the Pallas strategy's loss and gradients are compiled
with every candidate (sub-tile rows ``bs``, vocab block ``bv``) of `CANDIDATES` forced into the tiling
(`recloss.pallas.tuned` is given a one-entry table while it compiles) and with the heuristic's own pick,
checked against the heuristic's result, then timed in interleaved rounds. The fastest becomes the entry
for the shape's (objective, sweep modes, table dtype, D): a table (`table`) to write as the package's
``recloss/pallas/tuned/<chip>.json``, which `recloss.pallas.tiling.choose` then reads on that chip.
A candidate that does not compile (VMEM) or disagrees is left out, and the record says why.
"""

from __future__ import annotations

import contextlib
import time
from typing import Dict, List, Optional, Sequence

from recloss.bench import chip as chip_lib

CANDIDATES = ((512, 1024), (1024, 1024), (512, 2048), (1024, 2048))
# The sweep modes a shape's value_and_grad runs, per objective: the entry applies to each.
MODES = {"bce": ("fused",), "softmax": ("loss", "grad")}
HEURISTIC = "heuristic"


@contextlib.contextmanager
def forced(chip: str, objective: str, dtype: str, d: int, bs: int, bv: int):
    """`recloss.pallas.tuned` answers (bs, bv) for ``chip``'s modes of ``objective`` at ``dtype`` and D ``d``
    while the block runs (what a compile inside it tiles with)."""
    from recloss.pallas import tuned

    entries = [dict(objective=objective, mode=m, dtype=dtype, d=d, bs=bs, bv=bv) for m in MODES[objective]]
    saved = tuned.table
    tuned.table = lambda name: dict(chip=chip, entries=entries) if name == chip else saved(name)
    try:
        yield
    finally:
        tuned.table = saved


@contextlib.contextmanager
def unforced(chip: str):
    """`recloss.pallas.tuned` has no table for ``chip`` while the block runs: the heuristic's pick."""
    from recloss.pallas import tuned

    saved = tuned.table
    tuned.table = lambda name: None if name == chip else saved(name)
    try:
        yield
    finally:
        tuned.table = saved


def run(shapes: Sequence[str], rounds: int = 5, seed: int = 0, log=chip_lib._log) -> dict:
    """The search at ``shapes`` (keys of `recloss.bench.chip.SHAPES`): {'info', 'entries', 'shapes'}."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    import recloss
    from recloss import aot
    from recloss.pallas import tiling

    if jax.default_backend() != "tpu":
        raise RuntimeError(f"--tune measures a TPU; JAX's backend here is {jax.default_backend()!r}")
    unknown = [s for s in shapes if s not in chip_lib.SHAPES]
    if unknown:
        raise ValueError(f"unknown suite shape(s) {unknown}: expected some of {list(chip_lib.SHAPES)}")
    chip = tiling.get_chip().name
    info = dict(chip=chip, device=jax.devices()[0].device_kind, jax=jax.__version__,
                libtpu=aot.libtpu_version() or "unknown", recloss=recloss.__version__, rounds=rounds,
                date=time.strftime("%Y-%m-%d"), candidates=[list(c) for c in CANDIDATES])
    entries, per_shape = [], {}
    for key in shapes:
        shape = chip_lib.SHAPES[key]
        name = chip_lib.STRATEGIES[shape.objective][-1]
        h, e, t = chip_lib._inputs(shape, seed)
        rows: Dict[str, dict] = {}
        compiled = {}
        for cand in (HEURISTIC,) + CANDIDATES:
            # A new function each time: jit would reuse the first trace, and the tiling is chosen while tracing.
            loss = lambda h, e, t: shape.entry(h, e, t, strategy=name).loss
            fn = jax.jit(jax.value_and_grad(loss, argnums=(0, 1)))
            label = cand if cand == HEURISTIC else f"bs={cand[0]} bv={cand[1]}"
            ctx = unforced(chip) if cand == HEURISTIC else forced(chip, shape.objective, shape.dtype, shape.D, *cand)
            try:
                with ctx:
                    c = fn.lower(h, e, t).compile()
                out = jax.block_until_ready(c(h, e, t))
            except Exception as err:  # noqa: BLE001 - more VMEM than the chip has: recorded, not timed
                rows[label] = dict(error=str(err).strip().splitlines()[0][:200])
                log(f"[tune] {key} {label}: {rows[label]['error']}")
                continue
            loss_v = float(out[0])
            if cand == HEURISTIC:
                ref = (loss_v, jax.device_get(out[1][0]).astype(np.float32))
            else:
                dh = jax.device_get(out[1][0]).astype(np.float32)
                err = float(np.linalg.norm(dh - ref[1]) / max(np.linalg.norm(ref[1]), 1e-30))
                if abs(loss_v - ref[0]) > 1e-4 * abs(ref[0]) or err > chip_lib.CHECK_TOL["dhidden"]:
                    rows[label] = dict(error=f"disagrees with the heuristic's blocks: loss {loss_v} vs "
                                             f"{ref[0]}, dhidden {err:.3g}")
                    log(f"[tune] {key} {label}: {rows[label]['error']}")
                    continue
            del out
            rows[label] = dict(bs=None if cand == HEURISTIC else cand[0], bv=None if cand == HEURISTIC else cand[1],
                               times=[])
            compiled[label] = c
        order = np.random.default_rng(seed)
        labels = list(compiled)
        for _ in range(rounds):
            for i in order.permutation(len(labels)):
                t0 = time.perf_counter()
                jax.block_until_ready(compiled[labels[i]](h, e, t))
                rows[labels[i]]["times"].append(time.perf_counter() - t0)
        for label in labels:
            rows[label]["median_ms"] = round(1e3 * float(np.median(rows[label].pop("times"))), 3)
        with unforced(chip):
            picks = {m: tiling.choose((shape.objective, m), shape.B * shape.N, shape.V, shape.D,
                                      jnp.dtype(shape.dtype), jnp.dtype(shape.dtype), recloss.LossOptions(),
                                      bias=False, chip=tiling.get_chip()) for m in MODES[shape.objective]}
        rows[HEURISTIC]["picks"] = {m: [p.bs, p.bv] for m, p in picks.items()}
        best = min((lab for lab in labels if lab != HEURISTIC), key=lambda lab: rows[lab]["median_ms"], default=None)
        per_shape[key] = rows
        if best is not None and rows[best]["median_ms"] < rows[HEURISTIC]["median_ms"]:
            for m in MODES[shape.objective]:
                entries.append(dict(objective=shape.objective, mode=m, dtype=shape.dtype, d=shape.D,
                                    bs=rows[best]["bs"], bv=rows[best]["bv"], shape=key,
                                    ms=rows[best]["median_ms"], heuristic_ms=rows[HEURISTIC]["median_ms"]))
        log(f"[tune] {key}: " + ", ".join(f"{lab} {r.get('median_ms', r.get('error'))}" for lab, r in rows.items()))
        del h, e, t, compiled
    return dict(info=info, entries=_merge(entries), shapes=per_shape)


def _merge(entries: List[dict]) -> List[dict]:
    """One entry per (objective, mode, dtype, D): the fastest when two shapes share one."""
    best: Dict[tuple, dict] = {}
    for e in entries:
        k = (e["objective"], e["mode"], e["dtype"], e["d"])
        if k not in best or e["ms"] / e["heuristic_ms"] < best[k]["ms"] / best[k]["heuristic_ms"]:
            best[k] = e
    return sorted(best.values(), key=lambda e: (e["objective"], e["mode"], e["dtype"], e["d"]))


def table(payload: dict, command: Optional[str] = None) -> dict:
    """The package table of a `run` payload (what ``recloss/pallas/tuned/<chip>.json`` holds)."""
    info = payload["info"]
    measured = {k: info[k] for k in ("device", "jax", "libtpu", "date", "rounds")}
    if command:
        measured["command"] = command
    return dict(chip=info["chip"], measured=measured, entries=payload["entries"])


def format_table(payload: dict) -> str:
    """Each shape's candidates, as --tune prints them."""
    lines = [f"Block sizes on {payload['info']['device']} (jax {payload['info']['jax']}), medians of "
             f"{payload['info']['rounds']} interleaved rounds of the Pallas strategy's loss and gradients:", "",
             "| shape | blocks | ms | ÷ heuristic |", "|---|---|---:|---:|"]
    for key, rows in payload["shapes"].items():
        base = rows.get(HEURISTIC, {}).get("median_ms")
        for label, r in rows.items():
            if "median_ms" not in r:
                lines.append(f"| {key} | {label} | {r.get('error', '')[:60]} | |")
                continue
            pick = "" if label != HEURISTIC else " (" + ", ".join(f"{m} bs={b[0]} bv={b[1]}"
                                                                   for m, b in r["picks"].items()) + ")"
            ratio = f"{r['median_ms'] / base:.3f}" if base else ""
            lines.append(f"| {key} | {label}{pick} | {r['median_ms']:.2f} | {ratio} |")
    return "\n".join(lines)
