"""Records the pod-step tables of docs/sharding.md: the whole train step compiled per row.

    python -m tools.pod_figures --record docs/figures/pod            # every row (minutes)
    python -m tools.pod_figures --record docs/figures/pod --only 'v6e-8 paper step, vocab 8'

Each row of `tools.figures.POD_TABLES` is `recloss-train CONFIG OVERRIDES` with
``compile_topology`` set: this compiles it the way recloss-train does (`aot.compile_step`), and
merges its per-chip memory (MaxText's accounting: arguments + outputs + temporaries − aliased), its
compile time and the three largest buffers at the peak into this stack's record,
``docs/figures/pod/jax-<jax>_libtpu-<libtpu>.json``. The docs render the tables from the records at
build time, and `tests/test_pod_step.py` recompiles the pinned rows against them.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

from recloss import aot
from tools import figures


def compile_row(config: str, overrides, root: Path = figures.ROOT) -> dict:
    """The record row of `recloss-train config overrides` (``compile_topology`` among them), with the
    `recloss.aot.Peak` under ``"peak"`` (not recorded: the caller reports it)."""
    from recloss_plugins.config import load_config
    from recloss_plugins.sasrec import aot as step_aot, parallel

    cfg = load_config([str(root / config), *overrides])
    if not cfg.compile_topology:
        raise ValueError(f"pod row {config} {' '.join(overrides)} sets no compile_topology: nothing to compile for")
    devices = parallel.topology_devices(cfg.compile_topology, cfg.compile_topology_num_slices)
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="recloss-pod-") as dump:
        _, rep, program = step_aot.compile_step(cfg, devices, step_aot.vocab_size_for(cfg), dump_to=dump)
        peak = aot.read(dump)
    return dict(config=config, overrides=list(overrides), hbm_bytes=int(rep["total"]), temp_bytes=int(rep["temp"]),
                argument_bytes=int(rep["argument"]), output_bytes=int(rep["output"]), alias_bytes=int(rep["alias"]),
                mesh=dict(program.mesh.shape), global_batch_size=program.batch_size,
                compile_s=round(time.perf_counter() - t0, 1),
                largest=[b.describe().strip() for b in peak.buffers[:3]], peak=peak)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tools.pod_figures", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--record", required=True, metavar="DIR",
                        help="the records folder (docs/figures/pod); the file is named per stack")
    parser.add_argument("--only", action="append", default=[], metavar="ROW",
                        help="record just this row (repeatable; names: " + "; ".join(figures.pod_rows()) + ")")
    args = parser.parse_args(argv)
    rows = figures.pod_rows()
    unknown = [n for n in args.only if n not in rows]
    if unknown:
        parser.error(f"--only {unknown[0]!r} names no pod row (known: {'; '.join(rows)})")
    try:
        target = figures.check_record_dir(args.record)      # before minutes of compiles
    except figures.RecordError as err:
        parser.error(str(err))
    aot.libtpu_env()   # before libtpu loads: no "unexpected worker hostname" off a TPU VM
    names = args.only or list(rows)
    t0 = time.perf_counter()
    for i, name in enumerate(names, 1):
        config, row = rows[name]
        print(f"[pod] {i}/{len(names)} {name}: recloss-train {config} {' '.join(row.overrides)} ...",
              file=sys.stderr, flush=True)
        rec = compile_row(config, row.overrides)
        peak = rec.pop("peak")
        print(f"[pod]   {rec['hbm_bytes'] / 2**30:.3f} GiB per chip (temporaries {rec['temp_bytes'] / 2**30:.3f}), "
              f"compiled in {rec['compile_s']:.0f}s\n{aot.report(peak, top=3)}", file=sys.stderr, flush=True)
        path, replaced, added = figures.record_pod([rec], args.record)   # row by row: an interrupted run keeps its rows
    print(f"[pod] {target}: {len(names)} rows recorded in {time.perf_counter() - t0:.0f}s", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
