"""MaxText's own vocab tiling against the recloss loss, compiled for TPU topologies: the docs' table.

    python -m tools.maxtext_table --models qwen3-0.6b gemma-2b llama3.1-8b \\
        --topologies v6e-8 v5p-8 --points 4x2048 8x4096 --layers 2 --json docs/figures/data/maxtext.json

Each cell is one `recloss_plugins.maxtext.compile` run in a fresh process (MaxText's train_compile
leaves process-wide state behind) for one model × topology × ``per_device_batch_size × max_target_length``
point × column:

    maxtext          MaxText's default loss (num_vocab_tiling=1: the whole [tokens, V] logits)
    tiling{k}        num_vocab_tiling=k, k = 2, 4, 8
    tiling{k}-ag     the same with vocab_tiling_ag_once=true
    cutce            loss=cutce num_vocab_tiling=2
    cutce_pallas     loss=cutce_pallas num_vocab_tiling=2 loss_batch_axes=[data,fsdp] loss_fsdp_axis=fsdp
                     loss_fsdp_gather=ring (the kernel under shard_map: XLA cannot partition a Mosaic call)
    cutce_pallas-once  the same with the table all-gathered once per step (loss_fsdp_gather=once)
    cutce_pallas-rows  the same with the table slices home and the fsdp group's tokens gathered (rows)
    cutce_pallas-auto  loss=cutce_pallas num_vocab_tiling=2 alone: the plugin's defaults (the axes read
                     from MaxText's mesh, loss_fsdp_gather=auto; the cell records the mode it picked)

and records the step's per-chip HBM as MaxText counts it (`memory_analysis`), its temporaries, XLA's own
count (the buffer assignment the TPU compiler holds against the chip, from a dump each cell makes in a
temporary folder) and the compile's seconds, or
``oom`` when XLA reports that the step does not fit the chip (with the HBM it asked for where XLA says).
The JSON is rewritten after every cell and ``--resume`` skips the cells it already holds, so a long
recording can be stopped and continued. ``--full-depth MODEL`` adds rows at the model's own layer
count (the output layer's own memory does not depend on depth, where the step's peak lies does; the
rows show it), for the columns
``--full-depth-columns`` names (default: all). ``--largest [COLUMN ...]`` adds, per model × topology × column, the
largest point of a doubling ladder that still fits. `format_table` is the docs' table, `format_headline`
the README's.
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
from pathlib import Path
from typing import Dict, List, Optional, Sequence, Tuple

_PALLAS = ("loss=cutce_pallas", "num_vocab_tiling=2", "loss_batch_axes=[data,fsdp]", "loss_fsdp_axis=fsdp")
COLUMNS: Dict[str, Tuple[str, ...]] = {
    "maxtext": (),
    **{f"tiling{k}{ag}": (f"num_vocab_tiling={k}",) + (("vocab_tiling_ag_once=true",) if ag else ())
       for k in (2, 4, 8) for ag in ("", "-ag")},
    "cutce": ("loss=cutce", "num_vocab_tiling=2"),
    # A Mosaic kernel cannot be partitioned by XLA: the Pallas loss runs under shard_map over the
    # tokens, the FSDP-stored table's slices passed round the fsdp axis.
    "cutce_pallas": _PALLAS + ("loss_fsdp_gather=ring",),
    "cutce_pallas-once": _PALLAS + ("loss_fsdp_gather=once",),
    "cutce_pallas-rows": _PALLAS + ("loss_fsdp_gather=rows",),
    "cutce_pallas-auto": ("loss=cutce_pallas", "num_vocab_tiling=2"),
}
# The recloss column the ratio is taken of: the plugin's defaults where recorded, else the ring.
OURS = ("cutce_pallas-auto", "cutce_pallas")
MAXTEXT_COLUMNS = tuple(c for c in COLUMNS if not c.startswith("cutce"))
_LINE = re.compile(r"recloss-maxtext-compile: per-chip HBM (?P<total>[\d.]+) GiB \(temporaries (?P<temp>[\d.]+) GiB"
                   r"(?:; XLA's count (?P<xla>[\d.]+) GiB)?\), compiled in (?P<seconds>[\d.]+) s")
# XLA's TPU out-of-memory messages, e.g. "RESOURCE_EXHAUSTED: E1000: CompileTimeHbmOom: Ran out of memory on
# HBM, the total memory required for HLO temporaries (34.96G) exceeds available HBM (31.24G)" (libtpu 0.0.50)
# or "... Used 41.2G of 31.25G hbm. Exceeded hbm capacity by 10.0G." (older ones).
_OOM = re.compile(r"RESOURCE_EXHAUSTED|Ran out of memory|Exceeded hbm capacity|HbmOom", re.I)
_USED = re.compile(r"(?:Used |HLO temporaries \()(?P<used>[\d.]+)(?P<unit>[KMGT])?\)?"
                   r"(?: of | exceeds available HBM \()(?P<cap>[\d.]+)(?P<capunit>[KMGT])?")
_PICKED = re.compile(r"loss_fsdp_gather=auto: '(?P<mode>\w+)'")
_UNIT = {None: 2**-30, "": 2**-30, "K": 2**-20, "M": 2**-10, "G": 1.0, "T": 2**10}


# --largest's points, ascending in tokens per device.
LADDER = ((1, 2048), (2, 2048), (2, 4096), (4, 4096), (8, 4096), (16, 4096), (32, 4096), (64, 4096), (128, 4096))


def largest_fitting(ladder: Sequence[Tuple[int, int]], fits) -> Optional[Tuple[int, int]]:
    """The largest point of ``ladder`` (ascending) for which ``fits(point)`` is true, or None, by bisection:
    what fits is a prefix of the ladder (memory grows with the tokens), so about log2(len) probes."""
    lo, hi = -1, len(ladder)          # ladder[lo] fits (or lo = -1), ladder[hi] does not (or hi = len)
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if fits(ladder[mid]):
            lo = mid
        else:
            hi = mid
    return ladder[lo] if lo >= 0 else None


def parse_point(text: str) -> Tuple[int, int]:
    """``"8x4096"`` -> (per_device_batch_size, max_target_length)."""
    m = re.fullmatch(r"(\d+)x(\d+)", text)
    if not m or min(int(m.group(1)), int(m.group(2))) < 1:
        raise argparse.ArgumentTypeError(f"point {text!r}: expected BATCHxLENGTH with positive integers, "
                                         f"e.g. 8x4096 (per_device_batch_size x max_target_length)")
    return int(m.group(1)), int(m.group(2))


def point_name(point: Sequence[int]) -> str:
    return f"{point[0]}x{point[1]}"


def cell_key(model: str, topology: str, point: Sequence[int], layers: Optional[int], column: str) -> str:
    depth = "full" if layers is None else f"L{layers}"
    return f"{model}|{topology}|{point_name(point)}|{depth}|{column}"


def parse_output(text: str, returncode: int) -> Dict[str, object]:
    """One compile's combined stdout+stderr as a cell: ``{"status": "ok", "total_gib", "temp_gib",
    "seconds"}``, ``{"status": "oom", "used_gib"?, "capacity_gib"?}`` or ``{"status": "error", "message"}``."""
    m = _LINE.search(text)
    if returncode == 0 and m:
        cell = {"status": "ok", "total_gib": float(m.group("total")), "temp_gib": float(m.group("temp")),
                "seconds": float(m.group("seconds"))}
        if m.group("xla"):
            cell["xla_gib"] = float(m.group("xla"))
        picked = _PICKED.search(text)
        if picked:
            cell["gather"] = picked.group("mode")
        return cell
    if _OOM.search(text):
        cell: Dict[str, object] = {"status": "oom"}
        used = _USED.search(text)
        if used:
            cell["used_gib"] = round(float(used.group("used")) * _UNIT[used.group("unit")], 3)
            cell["capacity_gib"] = round(float(used.group("cap")) * _UNIT[used.group("capunit")], 3)
        return cell
    tail = [l for l in text.splitlines() if l.strip() and not re.match(r"[IW]\d{4} ", l)][-3:]
    return {"status": "error", "message": f"exit {returncode}: " + " | ".join(tail)[-600:]}


def compile_cell(base_yml: str, model: str, topology: str, point: Sequence[int], layers: Optional[int],
                 column: str, *, workdir: str, timeout: float) -> Dict[str, object]:
    """One cell's compile in a fresh process (see the module docstring)."""
    args = [base_yml, f"model_name={model}", f"compile_topology={topology}", "compile_topology_num_slices=1",
            f"per_device_batch_size={point[0]}", f"max_target_length={point[1]}", "run_name=recloss_table",
            f"base_output_directory={workdir}", "skip_jax_distributed_system=true", "log_config=false",
            "enable_checkpointing=false"]
    if layers is not None:
        args += ["override_model_config=true", f"base_num_decoder_layers={layers}"]
    args += list(COLUMNS[column])
    start = time.perf_counter()
    # XLA dumps the step's buffer assignment here, from which the command reads XLA's own HBM count.
    with tempfile.TemporaryDirectory(prefix="recloss-maxtext-dump-") as dump:
        flags = " ".join(filter(None, (os.environ.get("XLA_FLAGS", ""), f"--xla_dump_to={dump}")))
        env = dict(os.environ, JAX_PLATFORMS="cpu", TPU_SKIP_MDS_QUERY="1", XLA_FLAGS=flags)
        try:
            run = subprocess.run([sys.executable, "-m", "recloss_plugins.maxtext.compile", *args], env=env,
                                 capture_output=True, text=True, timeout=timeout)
            cell = parse_output(run.stdout + "\n" + run.stderr, run.returncode)
        except subprocess.TimeoutExpired:
            cell = {"status": "error", "message": f"compile ran past --timeout {timeout:g} s"}
    cell["wall_s"] = round(time.perf_counter() - start, 1)
    return cell


def _cell_text(cell: Optional[dict]) -> str:
    if cell is None:
        return "–"
    if cell["status"] == "ok":
        picked = f" ({cell['gather']})" if "gather" in cell else ""
        xla = f" · XLA {cell['xla_gib']:.2f}" if "xla_gib" in cell else ""
        return f"{cell['total_gib']:.2f} / {cell['temp_gib']:.2f}{xla} · {cell['seconds']:.0f} s{picked}"
    if cell["status"] == "oom":
        return f"OOM ({cell['used_gib']:.1f} GiB temp.)" if "used_gib" in cell else "OOM"
    return "error"


def ours(cells: Dict[str, dict]) -> Tuple[Optional[str], dict]:
    """(column, cell) of the recloss column a row's ratio is taken of (`OURS`: the first recorded)."""
    for column in OURS:
        if column in cells:
            return column, cells[column]
    return None, {}


def best_tiling(cells: Dict[str, dict], count: str = "total_gib") -> Optional[Tuple[str, float]]:
    """The MaxText column with the smallest per-chip HBM by ``count`` (``'total_gib'``: memory_analysis;
    ``'xla_gib'``: XLA's own) among those that compiled and recorded it, or None."""
    fits = [(c, cells[c][count]) for c in MAXTEXT_COLUMNS
            if cells.get(c, {}).get("status") == "ok" and count in cells[c]]
    return min(fits, key=lambda x: x[1]) if fits else None


def format_table(data: dict) -> str:
    """The recorded cells as Markdown: one row per model × topology × point × depth; each cell
    "total / temporaries (GiB per chip) · compile s"; the last column cutce_pallas over the best MaxText one."""
    cols = [c for c in COLUMNS if any(k.endswith("|" + c) for k in data["cells"])]
    rows = _rows(data["cells"])
    head = ["model", "topology", "batch × length", "layers", *cols, "recloss ÷ best MaxText"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for row, cells in rows.items():
        model, topology, point, depth = row.split("|")
        best = best_tiling(cells)
        which, mine = ours(cells)
        if mine.get("status") == "ok" and best:
            ratio = f"{mine['total_gib'] / best[1]:.2f} ({which} vs {best[0]})"
            best_xla = best_tiling(cells, "xla_gib")
            if "xla_gib" in mine and best_xla:
                ratio += f"; by XLA's count {mine['xla_gib'] / best_xla[1]:.2f} (vs {best_xla[0]})"
        elif mine.get("status") == "ok":
            ratio = "fits; no MaxText column does"
        else:
            ratio = "–"
        layers = "full" if depth == "full" else depth[1:]
        lines.append("| " + " | ".join([model, topology, point.replace("x", " × "), layers,
                                         *(_cell_text(cells.get(c)) for c in cols), ratio]) + " |")
    out = "\n".join(lines)
    if data.get("largest"):
        out += "\n\n" + format_largest(data)
    stack = data.get("stack", {})
    if stack:
        out += "\n\n" + "Compiled with " + ", ".join(f"{k} {v}" for k, v in stack.items()) + \
               f"; {data.get('layers', '?')} decoder layers unless the row says full."
    return out


def _rows(cells: Dict[str, dict]) -> Dict[str, Dict[str, dict]]:
    """{model|topology|point|depth: {column: cell}} in recording order."""
    rows: Dict[str, Dict[str, dict]] = {}
    for key, cell in cells.items():
        row, _, column = key.rpartition("|")
        rows.setdefault(row, {})[column] = cell
    return rows


def _gib(cell: Optional[dict]) -> str:
    if not cell:
        return "–"
    return f"{cell['total_gib']:.2f}" if cell["status"] == "ok" else ("OOM" if cell["status"] == "oom" else "error")


def format_headline(data: dict) -> str:
    """The README's summary of the table: per model × topology × point at the recorded depth, per-chip HBM
    (GiB) of MaxText's default loss, of its best ``num_vocab_tiling`` column, and of ``loss=cutce_pallas``
    (`ours`: at the plugin's defaults where recorded, else the ring) with its ratio to that best."""
    head = ["model", "topology", "batch × length", "MaxText default", "MaxText's best tiling",
            "loss=cutce_pallas", "÷ best"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for row, cells in _rows(data["cells"]).items():
        model, topology, point, depth = row.split("|")
        if depth == "full":
            continue
        best = best_tiling(cells)
        mine = ours(cells)[1]
        ratio = (f"{mine['total_gib'] / best[1]:.2f}" if best and mine.get("status") == "ok" else "–")
        lines.append("| " + " | ".join([
            model, topology, point.replace("x", " × "), _gib(cells.get("maxtext")),
            f"{best[1]:.2f} ({best[0]})" if best else "none fits", _gib(mine or None), ratio]) + " |")
    stack = data.get("stack", {})
    return "\n".join(lines) + ("\n\nper-chip HBM in GiB (arguments + outputs + temporaries − aliased), compiled with "
                               + ", ".join(f"{k} {v}" for k, v in stack.items())
                               + f", {data.get('layers', '?')} decoder layers" if stack else "")


def format_largest(data: dict) -> str:
    """The largest ladder point that compiled, per model × topology × column."""
    cols = [c for c in COLUMNS if any(k.endswith("|" + c) for k in data["largest"])]
    rows: Dict[str, Dict[str, str]] = {}
    for key, point in data["largest"].items():
        row, _, column = key.rpartition("|")
        rows.setdefault(row, {})[column] = point
    head = ["largest batch × length that fits", *cols]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for row, found in rows.items():
        model, topology = row.split("|")
        lines.append("| " + " | ".join([f"{model} on {topology}",
                                         *((found.get(c) or "none").replace("x", " × ") for c in cols)]) + " |")
    return "\n".join(lines)


def _stack() -> Dict[str, str]:
    import importlib.metadata as md

    out = {}
    for name in ("maxtext", "jax", "libtpu"):
        try:
            out[name] = md.version(name)
        except md.PackageNotFoundError:
            pass
    return out


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tools.maxtext_table", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", nargs="+", default=["qwen3-0.6b", "gemma-2b", "llama3.1-8b"])
    parser.add_argument("--topologies", nargs="+", default=["v6e-8", "v5p-8"])
    parser.add_argument("--points", nargs="+", type=parse_point, default=[(4, 2048), (8, 4096)],
                        help="per_device_batch_size x max_target_length points (default: 4x2048 8x4096)")
    parser.add_argument("--columns", nargs="+", choices=list(COLUMNS), default=list(COLUMNS))
    parser.add_argument("--layers", type=int, default=2, help="base_num_decoder_layers (default: %(default)s)")
    parser.add_argument("--full-depth", nargs="*", default=[], metavar="MODEL",
                        help="also compile these models at their own depth, at their first point and topology")
    parser.add_argument("--full-depth-columns", nargs="+", choices=list(COLUMNS), default=None, metavar="COLUMN",
                        help="the columns of the --full-depth rows (default: --columns)")
    parser.add_argument("--largest", nargs="*", choices=list(COLUMNS), default=None, metavar="COLUMN",
                        help="per model x topology x these columns (none named: --columns), the largest point of the ladder 1x2048, 2x2048, "
                             "2x4096, 4x4096, ..., 128x4096 that compiles (bisection: ~4 compiles each)")
    parser.add_argument("--json", required=True, help="results file, rewritten after every cell")
    parser.add_argument("--resume", action="store_true", help="keep the cells the --json file already holds")
    parser.add_argument("--timeout", type=float, default=1200, help="seconds per compile (default: %(default)s)")
    parser.add_argument("--base-yml", default=None, help="MaxText's base.yml (default: the installed MaxText's)")
    args = parser.parse_args(argv)
    if args.layers < 1:
        parser.error(f"--layers {args.layers}: expected a positive layer count")
    unknown = sorted(set(args.full_depth) - set(args.models))
    if unknown:
        parser.error(f"--full-depth {' '.join(unknown)}: not among --models {' '.join(args.models)}")
    base_yml = args.base_yml
    if base_yml is None:
        try:
            from maxtext.utils.globals import MAXTEXT_CONFIGS_DIR
        except ImportError as err:
            parser.error(f"MaxText does not import ({err}): install recloss[maxtext] on Python >= 3.12, "
                         f"or pass --base-yml")
        base_yml = os.path.join(MAXTEXT_CONFIGS_DIR, "base.yml")

    path = Path(args.json)
    data = {"cells": {}, "largest": {}}
    if args.resume and path.exists():
        data = json.loads(path.read_text())
        data.setdefault("largest", {})
    data.update(layers=args.layers, stack=_stack())
    workdir = str(Path(os.environ.get("TMPDIR", "/tmp")) / "recloss_maxtext_table")

    def save():
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(data, indent=1, sort_keys=False) + "\n")

    jobs: List[Tuple[str, str, Tuple[int, int], Optional[int], str]] = []
    for model in args.models:
        for topology in args.topologies:
            for point in args.points:
                jobs += [(model, topology, point, args.layers, c) for c in args.columns]
        if model in args.full_depth:
            jobs += [(model, args.topologies[0], args.points[0], None, c)
                     for c in (args.full_depth_columns or args.columns)]
    todo = [j for j in jobs if cell_key(*j) not in data["cells"]]
    print(f"maxtext table: {len(todo)} compiles to run ({len(jobs) - len(todo)} already in {path})", flush=True)
    start = time.perf_counter()
    for i, job in enumerate(todo, 1):
        cell = compile_cell(base_yml, *job, workdir=workdir, timeout=args.timeout)
        data["cells"][cell_key(*job)] = cell
        save()
        elapsed = time.perf_counter() - start
        print(f"[{i}/{len(todo)}] {cell_key(*job)}: {_cell_text(cell)}"
              f"{' ' + cell['message'] if cell['status'] == 'error' else ''} "
              f"({cell['wall_s']:.0f} s; ~{elapsed / i * (len(todo) - i) / 60:.0f} min left)", flush=True)

    if args.largest is not None:
        for model in args.models:
            for topology in args.topologies:
                for column in (args.largest or args.columns):
                    key = f"{model}|{topology}|{column}"
                    if key in data["largest"]:
                        continue

                    def fits(point, model=model, topology=topology, column=column):
                        ck = cell_key(model, topology, point, args.layers, column)
                        cell = data["cells"].get(ck) or data.setdefault("ladder", {}).get(ck)
                        if cell is None:
                            cell = compile_cell(base_yml, model, topology, point, args.layers, column,
                                                workdir=workdir, timeout=args.timeout)
                            data["ladder"][ck] = cell
                            save()
                            print(f"[largest] {ck}: {_cell_text(cell)} ({cell['wall_s']:.0f} s)", flush=True)
                        return cell["status"] == "ok"

                    found = largest_fitting(LADDER, fits)
                    data["largest"][key] = None if found is None else point_name(found)
                    save()
    print(format_table(data))
    return 0


if __name__ == "__main__":
    sys.exit(main())
