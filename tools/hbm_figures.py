"""Records the per-chip HBM rows of the README's and docs/benchmarks.md's TPU tables.

    python -m tools.hbm_figures --record docs/figures/hbm --topology v6e-8                       # BCE, paper shapes
    python -m tools.hbm_figures --record docs/figures/hbm --topology v6e-8 --objective softmax --shapes table2

Each shape is `recloss-bench --topology ... --shapes B,N,D,V --json` (the user's tool, one chip of
the topology compiled ahead of time); its rows are merged into this stack's record,
``<DIR>/jax-<jax>_libtpu-<libtpu>.json``, shape by shape (an interrupted recording keeps what it
compiled; a row of the same topology, objective, strategy and shape is replaced). The tables render
from the records (`tools.figures`); ``make figures`` records both legs.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

from tools import figures

def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tools.hbm_figures", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--record", required=True, metavar="DIR",
                        help="the records folder (docs/figures/hbm); the file is named per stack")
    parser.add_argument("--topology", required=True, help="as recloss-bench --topology (v6e-8, v5e-8, ...)")
    parser.add_argument("--objective", default="bce", help="as recloss-bench --objective (default bce)")
    parser.add_argument("--shapes", default="paper",
                        help="the table's shapes: paper, table2, table3, or B,N,D,V[;B,N,D,V...] (default paper)")
    parser.add_argument("--strategies", default=None, help="as recloss-bench --strategies (default: its own)")
    args = parser.parse_args(argv)
    try:
        target = figures.check_record_dir(args.record)      # before minutes of compiles
    except figures.RecordError as err:
        parser.error(str(err))
    from recloss.bench import cli, topology

    named = dict(paper=topology.PAPER_SHAPES, table2=topology.TABLE_II, table3=topology.TABLE_III)
    shapes = ([f"{s.B},{s.N},{s.D},{s.V}" for s in named[args.shapes]] if args.shapes in named
              else args.shapes.split(";"))       # recloss-bench checks each
    extra = ["--strategies", args.strategies] if args.strategies else []
    added = replaced = 0
    with tempfile.TemporaryDirectory(prefix="recloss-hbm-") as tmp:
        out = Path(tmp) / "rows.json"
        for i, s in enumerate(shapes, 1):
            print(f"[hbm] {i}/{len(shapes)} {args.topology} {args.objective} {s} ...", file=sys.stderr, flush=True)
            cli.main(["--topology", args.topology, "--objective", args.objective, *extra, "--shapes", s,
                      "--json", str(out)])
            payload = json.loads(out.read_text())
            _, r, a = figures.record(payload["rows"], args.objective, target.parent)
            added, replaced = added + a, replaced + r
    print(f"[hbm] recorded {len(shapes)} shapes in {target} ({added} rows new, {replaced} replaced)", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
