"""The README's per-chip HBM figures: recorded per software stack, rendered into README.md, guarded.

AOT memory analysis is deterministic for a given libtpu, so each (jax, libtpu) pair gets one
committed record file, ``docs/figures/hbm/jax-<jax>_libtpu-<libtpu>.json``:

    {"format": 1,
     "stack": {"python": ..., "jax": ..., "jaxlib": ..., "libtpu": ..., "tokamax": ... or null},
     "rows": [{"topology": "v6e-8", "objective": "bce", "strategy": "cutbce_pallas",
               "B": 8, "N": 256, "D": 256, "V": 876939, "L": 8, "dtype": "float32", "options": {},
               "argument_bytes": ..., "output_bytes": ..., "temp_bytes": ..., "hbm_bytes": ...,
               "flops": ..., "ideal_flops": ..., "compile_s": ...}, ...]}

(a cell that did not compile holds "OOM" or "error: ..." instead of its bytes and flops).

    python -m tools.hbm_figures --topology v6e-8 --record docs/figures/hbm   # adds/replaces rows of this stack's file
    python -m tools.figures                               # renders README.md's marked tables
    python -m tools.figures --check                       # exit 1 when README.md differs

A README table is the block between ``<!-- figures:NAME stack=STACK -->`` and
``<!-- /figures:NAME -->``; `TABLES` says what NAME shows (topology, objective, shapes, the command
that records it) and STACK names the record file it is rendered from. `tests/test_figures.py`
checks the README against the files and recompiles `GUARD_ROWS` against this stack's file.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import fcntl
import json
import os
import re
import sys
from pathlib import Path
from typing import Callable, Dict, List, Optional, Sequence, Tuple

FORMAT = 1
ROOT = Path(__file__).resolve().parents[1]     # the repository: this folder is not installed
FIGURES_DIR = ROOT / "docs" / "figures"
RECORDS_DIR = FIGURES_DIR / "hbm"
README = ROOT / "README.md"
# Fields that name a row (its key); a later recording of the same key replaces it.
KEY_FIELDS = ("topology", "objective", "strategy", "B", "N", "D", "V", "L", "dtype", "options")
MEASURED = ("argument_bytes", "output_bytes", "temp_bytes", "hbm_bytes", "flops")
# A guarded figure may grow by this fraction of its recorded value before the guard fails.
TOLERANCE = 0.05
ENV = "JAX_PLATFORMS=cpu TPU_SKIP_MDS_QUERY=1"


class RecordError(ValueError):
    """A record file that is missing, unreadable, or of another stack."""


# ----------------------------------------------------------------------------- the stack
def _dist_version(*names: str) -> Optional[str]:
    import importlib.metadata as md
    for name in names:
        try:
            return md.version(name)
        except md.PackageNotFoundError:
            continue
    return None


def current_stack() -> dict:
    """The versions AOT figures depend on: python, jax, jaxlib, libtpu (None when absent), tokamax."""
    import platform
    from recloss.bench import peers
    return dict(python=platform.python_version(), jax=_dist_version("jax"), jaxlib=_dist_version("jaxlib"),
                libtpu=_dist_version("libtpu", "libtpu-nightly"), tokamax=peers.version())


def stack_id(stack: dict) -> str:
    """The record file's stem: ``jax-<jax>_libtpu-<libtpu>``."""
    return f"jax-{stack['jax']}_libtpu-{stack['libtpu'] or 'none'}"


def record_file(stack: Optional[dict] = None, records_dir: Optional[Path] = None) -> Path:
    stack = current_stack() if stack is None else stack
    return Path(RECORDS_DIR if records_dir is None else records_dir) / f"{stack_id(stack)}.json"


# ----------------------------------------------------------------------------- reading and writing
def row_key(row: dict) -> Tuple:
    return tuple(json.dumps(row.get(k, {} if k == "options" else None), sort_keys=True) for k in KEY_FIELDS)


def load(path: Path) -> dict:
    path = Path(path)
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError:
        raise RecordError(f"no record file {path}") from None
    except (OSError, ValueError) as err:
        raise RecordError(f"cannot read record file {path}: {err}") from None
    if not isinstance(data, dict) or data.get("format") != FORMAT or not isinstance(data.get("rows"), list):
        raise RecordError(f"{path} is not a recloss figures record (format {FORMAT}: stack + rows)")
    return data


def check_record_dir(path) -> Path:
    """``path`` as a directory the per-stack file can be written to (created if missing), or
    RecordError naming it. Called before any compile, so a bad path costs nothing."""
    path = Path(path)
    if path.suffix == ".json" or (path.exists() and not path.is_dir()):
        raise RecordError(f"--record {path}: expects a directory (the file name is chosen per stack: "
                          f"{path if path.is_dir() else path.parent}/{stack_id(current_stack())}.json)")
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as err:
        raise RecordError(f"--record {path}: cannot create the directory ({err.strerror or err})") from None
    if not os.access(path, os.W_OK):
        raise RecordError(f"--record {path}: the directory is not writable")
    target = record_file(records_dir=path)
    if target.exists():
        load(target)        # a corrupt file fails now, not after the compiles
    return target


def dumps(data: dict) -> str:
    """The record as JSON with one row per line (a re-recording diffs row by row)."""
    head = {k: v for k, v in data.items() if k != "rows"}
    body = ",\n".join("  " + json.dumps(r) for r in data["rows"])
    return json.dumps(head, indent=1)[:-2] + ',\n "rows": [\n' + body + "\n ]\n}\n"


def record(rows: Sequence[dict], objective: str, records_dir, stack: Optional[dict] = None) -> Tuple[Path, int, int]:
    """Merges ``rows`` (of `topology.topology_rows`, computed for ``objective``) into this stack's
    file under ``records_dir``: a row of the same key is replaced in place, new rows are appended.
    Returns (path, replaced, added)."""
    stack = current_stack() if stack is None else stack
    with _locked(Path(records_dir)):     # two recordings of one stack at once merge, not overwrite
        return _record(rows, objective, Path(records_dir) / f"{stack_id(stack)}.json", stack)


@contextlib.contextmanager
def _locked(directory: Path):
    fd = os.open(directory, os.O_RDONLY)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)


def _record(rows, objective, path: Path, stack: dict):
    rows = [dict(row, objective=objective, options=row.get("options", {})) for row in rows]
    return _merge(path, stack, rows, row_key, KEY_FIELDS + MEASURED)


def _merge(path: Path, stack: dict, rows, key, first: Sequence[str]):
    """Rows into the record at ``path`` (created for ``stack``), by ``key``; fields ``first`` lead."""
    data = load(path) if path.exists() else dict(format=FORMAT, stack=stack, rows=[])
    old = data.get("stack", {})
    if (old.get("jax"), old.get("libtpu")) != (stack["jax"], stack["libtpu"]):
        raise RecordError(f"{path} records jax {old.get('jax')} / libtpu {old.get('libtpu')}, "
                          f"not this stack (jax {stack['jax']} / libtpu {stack['libtpu']})")
    data["stack"] = stack           # python, jaxlib, tokamax: as of the latest recording
    index = {key(r): i for i, r in enumerate(data["rows"])}
    replaced = added = 0
    for row in rows:
        row = {**{k: row[k] for k in first if k in row}, **{k: v for k, v in row.items() if k not in first}}
        k = key(row)
        if k in index:
            data["rows"][index[k]] = row
            replaced += 1
        else:
            index[k] = len(data["rows"])
            data["rows"].append(row)
            added += 1
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(dumps(data))
    os.replace(tmp, path)
    return path, replaced, added


# ----------------------------------------------------------------------------- the README's tables
@dataclasses.dataclass(frozen=True)
class Table:
    """One README table: the rows of ``objective`` on ``topology`` at ``shapes`` (options {})."""
    topology: str
    objective: str
    shapes: str                  # a --shapes value: 'paper', 'table2', 'table3'
    venv: str                    # the venv whose stack the README shows it for (its command's prefix)
    comment: str = ""
    only: Optional[Tuple[int, int, int, int]] = None   # (B, N, D, V): just this shape of ``shapes``

    @property
    def argv(self) -> str:
        obj = "" if self.objective == "bce" else f" --objective {self.objective}"
        shapes = "" if self.shapes == "paper" else f" --shapes {self.shapes}"
        return f"--topology {self.topology}{obj}{shapes}"

    def command(self, records_dir: str = "docs/figures/hbm") -> str:
        return f"{ENV} {self.venv}/bin/python -m tools.hbm_figures {self.argv} --record {records_dir}"

    def shape_list(self):
        from recloss.bench import topology
        shapes = dict(paper=topology.PAPER_SHAPES, table2=topology.TABLE_II, table3=topology.TABLE_III)[self.shapes]
        return [s for s in shapes if self.only is None or (s.B, s.N, s.D, s.V) == self.only]


TABLES: Dict[str, Table] = {
    "v6e-bce": Table("v6e-8", "bce", "paper", ".venv", comment="also v5e-8, v5p-8"),
    "v6e-softmax": Table("v6e-8", "softmax", "table2", ".venv312"),
    # README.md's headline: the paper's per-chip shape of the v6e-bce table.
    "v6e-headline": Table("v6e-8", "bce", "paper", ".venv", only=(8, 256, 256, 876_939)),
}


@dataclasses.dataclass(frozen=True)
class CpuTable:
    """One CPU timing table: what `recloss-bench ARGS --json docs/figures/FILE` printed, kept as its
    JSON payload and rendered by the same `rows.format_cpu` that prints recloss-bench's table
    (timings are this machine's, not a stack's)."""
    file: str                    # under docs/figures: 'cpu/bce.json'
    args: str = ""               # recloss-bench arguments besides --json
    target: str = "bench"        # the make target: 'bench-py312' runs the Python 3.12 venv (Tokamax)

    def command(self) -> str:
        extra = f"{self.args} " if self.args else ""
        return f'make {self.target} BENCH_ARGS="{extra}--json docs/figures/{self.file}"'


CPU_TABLES: Dict[str, CpuTable] = {
    "cpu-bce": CpuTable("cpu/bce.json"),
    # Tokamax takes one label per position: its peer rows need --labels 1 and Python >= 3.12.
    "cpu-softmax-l1": CpuTable("cpu/softmax-l1.json", "--objective softmax --labels 1 --repeats 7", "bench-py312"),
    "cpu-softmax": CpuTable("cpu/softmax.json", "--objective softmax --repeats 7", "bench-py312"),
}


@dataclasses.dataclass(frozen=True)
class CpuRuns:
    """The run-to-run spread of `make bench`: one line of ratios per results file (the same code, run
    one after another), and the ranges the benchmark page's prose reasons from."""
    files: Tuple[str, ...]       # under docs/figures

    def command(self) -> str:
        stems = " ".join(Path(f).with_suffix("").as_posix() for f in self.files)
        return f'for f in {stems}; do make bench BENCH_ARGS="--json docs/figures/$f.json"; done'


@dataclasses.dataclass(frozen=True)
class ChipRecord:
    """What a command run on a TPU host wrote (the on-chip suite, `make test-tpu`), rendered by
    ``render(payload)``: `recloss.bench.chip`'s formatters, the same recloss-bench prints."""
    file: str                    # under docs/figures
    command: str
    render: Callable[[dict], str]


def _chip_formatter(name: str) -> Callable[[dict], str]:
    def render(payload: dict) -> str:
        from recloss.bench import chip
        return getattr(chip, name)(payload)
    return render


_SUITE = "recloss-bench --chip --json docs/figures/tpu/v5e-suite.json"
_TABLE3 = "recloss-train --table3 --json docs/figures/tpu/v5e-table3.json --rows ROWS"
# The rows of Table III's grid recorded so far (8 December: batch 8, N = 256, both V); batch 16 and
# N = 512 at V = 876,939 are owed (issue 61), and with them this restriction goes.
TABLE3_ROWS = "b=8 ,N=256"


def _table3_formatter(name: str) -> Callable[[dict], str]:
    def render(payload: dict) -> str:
        from recloss_plugins.sasrec import speed
        return getattr(speed, name)(payload, speed.select(speed.paper_rows(), TABLE3_ROWS))
    return render


CHIP_RECORDS: Dict[str, ChipRecord] = {
    # The paper's Table III on one v5e: the trainer's steps/s, per-chip HBM and the step's parts.
    "tpu-v5e-table3": ChipRecord("tpu/v5e-table3.json", _TABLE3, _table3_formatter("format_table")),
    "tpu-v5e-table3-short": ChipRecord("tpu/v5e-table3.json", _TABLE3, _table3_formatter("format_short")),
    # Timed on one real TPU v5e chip: `make test-tpu` and the suite ran there (docs/kernels.md).
    "tpu-v5e-suite": ChipRecord("tpu/v5e-suite.json", _SUITE, _chip_formatter("format_table")),
    "tpu-v5e-suite-summary": ChipRecord("tpu/v5e-suite.json", _SUITE, _chip_formatter("format_summary")),
    "tpu-tests": ChipRecord("tpu/tests.json", "make test-tpu TPU_PYTHON=python3", _chip_formatter("format_tests")),
    # After the bf16-table change of the gradient kernels (one resident tile, dE rounded from VMEM): the two
    # shapes it moves, and the kernel tests it touches.
    "tpu-v5e-suite-bf16-table": ChipRecord(
        "tpu/v5e-suite-bf16-table.json", "recloss-bench --chip --chip-shapes llm-head-bf16,paper-bf16 --repeats 5 "
        "--json docs/figures/tpu/v5e-suite-bf16-table.json", _chip_formatter("format_table")),
    # A [D, V] table path for the kernels (`table_layout='DV'`), measured on branch table-layout-dv and not
    # shipped: the suite's two bf16 shapes with its `[D, V]` rows beside the kernels on [V, D].
    "tpu-v5e-suite-dv": ChipRecord(
        "tpu/v5e-suite-dv.json", "git checkout table-layout-dv && recloss-bench --chip --chip-shapes "
        "llm-head-bf16,paper-bf16 --repeats 5 --json docs/figures/tpu/v5e-suite-dv.json", _chip_formatter("format_table")),
    # What exactness costs from 10^6 to 10^9 items on v5e-256 (docs/sharding.md): each row's step compiled
    # here, with the per-chip times `python -m tools.cost_figures chip` measured on a v5e beside it.
    "cost-v5e-256": ChipRecord(
        "cost/v5e-256.json", "python -m tools.cost_figures record --chip docs/figures/tpu/v5e-cost.json "
        "--out docs/figures/cost/v5e-256.json", lambda payload: _cost_table(payload)),
    "tpu-tests-kernels": ChipRecord(
        "tpu/tests-kernels.json", "make test-tpu TPU_PYTHON=python3 TPU_RECORD=docs/figures/tpu/tests-kernels.json "
        "PYTEST_ARGS=\"-k 'rounded_once or sparse_term or cancels or test_bf16 or all_options or odd_shapes'\"",
        _chip_formatter("format_tests")),
}


def _cost_table(payload: dict) -> str:
    from tools import cost_table
    return cost_table.format_table(payload)


def render_chip_record(name: str, figures_dir: Optional[Path] = None) -> str:
    """The block of chip record ``name`` from ``<figures_dir>/<file>`` (without its marker lines)."""
    rec = CHIP_RECORDS[name]
    path = Path(FIGURES_DIR if figures_dir is None else figures_dir) / rec.file
    try:
        payload = json.loads(path.read_text())
    except (OSError, ValueError) as err:
        raise RecordError(f"cannot read chip record {path} ({err}): write it on a TPU host with `{rec.command}`") from err
    return rec.render(payload)


CPU_RUNS: Dict[str, CpuRuns] = {
    "cpu-bce-runs": CpuRuns(("cpu/bce.json", "cpu/bce-2.json", "cpu/bce-3.json", "cpu/bce-4.json")),
}
# The strategies' order within a shape (others follow, by name).
ORDER = ("dense_bce", "cutbce", "cutbce_pallas", "dense_ce", "cutce", "cutce_pallas",
         "tokamax:xla", "tokamax:chunked_xla", "tokamax:mosaic_tpu")


def table_rows(table: Table, data: dict) -> List[dict]:
    """The recorded rows of ``table``: shape by shape in its order, strategies in `ORDER`; every
    strategy recorded at one of its shapes must be recorded at all of them (no half-recorded table)."""
    out, per_shape = [], []
    for shape in table.shape_list():
        found = [r for r in data["rows"] if r.get("topology") == table.topology
                 and r.get("objective") == table.objective and not r.get("options")
                 and (r["B"], r["N"], r["D"], r["V"], r.get("dtype", "float32")) ==
                 (shape.B, shape.N, shape.D, shape.V, shape.dtype)
                 and (r["L"] == shape.L or r["strategy"].startswith("tokamax:"))]
        if not found:
            raise RecordError(f"the record has no {table.objective} row at {tuple(shape)} on {table.topology}: "
                              f"record it with `{table.command()}`")
        out += sorted(found, key=lambda r: (ORDER.index(r["strategy"]) if r["strategy"] in ORDER else len(ORDER),
                                            r["strategy"]))
        per_shape.append((shape, {r["strategy"] for r in found}))
    every = set().union(*(names for _, names in per_shape))
    for shape, names in per_shape:
        if names != every:
            raise RecordError(f"the record has {', '.join(sorted(every - names))} at some {table.objective} "
                              f"shapes on {table.topology} but not at {tuple(shape)}: record the whole table "
                              f"with `{table.command()}`")
    return out


def render_table(name: str, stack: str, records_dir: Optional[Path] = None) -> str:
    """The README block of table ``name`` from the record file ``<records_dir>/<stack>.json``
    (without its marker lines)."""
    from recloss.bench import rows as bench_rows

    table = TABLES[name]
    path = Path(RECORDS_DIR if records_dir is None else records_dir) / f"{stack}.json"
    data = load(path)
    st = data["stack"]
    rel = f"docs/figures/hbm/{path.name}"
    versions = ", ".join(f"{k} {st[k]}" for k in ("python", "jax", "jaxlib", "libtpu", "tokamax") if st.get(k))
    comment = f"     # {table.comment}" if table.comment else ""
    lines = [
        "```sh",
        f"{table.command()}{comment}",
        "python -m tools.figures      # renders README.md's tables from the records (the docs: at build time)",
        "```",
        "",
        f"Recorded in [`{rel}`]({rel}) ({versions}):",
        "",
        bench_rows.format_topology(table.topology, table_rows(table, data), table.objective),
    ]
    return "\n".join(lines)


def render_cpu_table(name: str, figures_dir: Optional[Path] = None) -> str:
    """The block of CPU table ``name`` from ``<figures_dir>/<file>`` (without its marker lines)."""
    from recloss.bench import rows as bench_rows

    table = CPU_TABLES[name]
    path = Path(FIGURES_DIR if figures_dir is None else figures_dir) / table.file
    data = _load_cpu(path, table.command())
    info, results = data["info"], data["rows"]
    rel = f"docs/figures/{table.file}"
    return "\n".join([
        "```sh",
        table.command(),
        "```",
        "",
        f"Recorded in [`{rel}`]({rel}):",
        "",
        bench_rows.format_cpu(results, info, data.get("notes", ())),
        "",
        bench_rows.format_cpu_total(info),
    ])


def _load_cpu(path: Path, command: str) -> dict:
    try:
        data = json.loads(path.read_text())
        data["info"], data["rows"]
    except (OSError, ValueError, KeyError, TypeError) as err:
        raise RecordError(f"cannot read CPU results file {path} ({err}): write it with `{command}`") from err
    return data


def render_cpu_runs(name: str, figures_dir: Optional[Path] = None) -> str:
    """The block of run series ``name``: per run the matmul ceiling and the fused pass's ratios, then
    the ranges over the runs (matmuls-only share of the ceiling, what the loss math adds, the time a
    fused pass at a quarter of dense_bce would need against the same-run ceiling)."""
    from recloss.bench.rows import MATMULS_ONLY, OPTAX_LABEL

    runs = CPU_RUNS[name]
    base = Path(FIGURES_DIR if figures_dir is None else figures_dir)
    lines = ["```sh", runs.command(), "```", "",
             "Recorded in " + ", ".join(f"[`{Path(f).name}`](docs/figures/{f})" for f in runs.files) + ":", "",
             "| run | ceiling GFLOP/s | fused / dense_bce | fused / optax | fused / recompute | fused, of matmul "
             "| fused / matmuls only |", "|---|---|---|---|---|---|---|"]
    spans = {k: [] for k in ("matmuls", "adds", "ns", "dense", "quarter", "optax")}
    for i, f in enumerate(runs.files, 1):
        data = _load_cpu(base / f, runs.command())
        by = {r["strategy"]: r for r in data["rows"]}
        try:
            fused, dense, rec, mm = (by["cutbce (fused)"], by["dense_bce"], by["cutbce (recompute, paper design)"],
                                     by[MATMULS_ONLY])
        except KeyError as err:
            raise RecordError(f"CPU results file {base / f} has no {err} row: rerun `{runs.command()}`") from err
        ceiling = data["info"]["matmul_gflops_per_s"]
        optax = by.get(OPTAX_LABEL)
        ratio = lambda r: f"{fused['median_s'] / r['median_s']:.3f}" if r else "–"
        lines.append(f"| {i} | {ceiling:.1f} | {ratio(dense)} | {ratio(optax)} | {ratio(rec)} | "
                     f"{100 * fused['matmul_fraction']:.0f}% | {fused['median_s'] / mm['median_s']:.2f} |")
        logits = fused["batch"] * fused["seq"] * fused["vocab"]
        spans["matmuls"].append(100 * mm["matmul_fraction"])
        spans["adds"].append(100 * (fused["median_s"] / mm["median_s"] - 1))
        spans["ns"].append(1e9 * (fused["median_s"] - mm["median_s"]) / logits)
        spans["dense"].append(dense["median_s"])
        spans["quarter"].append(100 * fused["nominal_gflop"] / (dense["median_s"] / 4) / ceiling)
        if optax:
            spans["optax"].append(fused["median_s"] / optax["median_s"])
    rng = lambda k, fmt: f"{fmt.format(min(spans[k]))}–{fmt.format(max(spans[k]))}"
    lines += ["", f"Over these runs: the blocked matmuls alone reach {rng('matmuls', '{:.0f}')}% of the same-run "
              f"2048³ rate; the loss math adds {rng('adds', '{:.0f}')}% on top, {rng('ns', '{:.2f}')} ns per logit; "
              f"`dense_bce` takes {rng('dense', '{:.2f}')} s, so a fused pass at a quarter of it would run at "
              f"{rng('quarter', '{:.0f}')}% of the same-run matmul rate"
              + (" (faster than the matmul alone: no exact implementation gets there on this CPU)"
                 if min(spans["quarter"]) > 100 else "")
              + (f"; against the optax code the fused pass takes {rng('optax', '{:.3f}')} of its time." if spans["optax"]
                 else ".")]
    return "\n".join(lines)


# ----------------------------------------------------------------------------- the pod-step tables
POD_DIR = FIGURES_DIR / "pod"
POD_RECORD = "python -m tools.pod_figures --record docs/figures/pod"
POD_MAKE = "make pod-figures"


@dataclasses.dataclass(frozen=True)
class PodRow:
    """One row of a pod-step table: `recloss-train CONFIG OVERRIDES` with ``compile_topology`` set,
    i.e. the whole train step (model, loss, AdamW update) compiled for the pod's chips."""
    name: str                    # how tests and the recorder name it
    cells: Tuple[str, ...]       # the leading cells: what the row is
    overrides: Tuple[str, ...]   # recloss-train key=value after the config
    cited: Tuple[str, ...] = ()  # trailing cells that are not ours to measure (the paper's figures)
    pinned: bool = False         # tests/test_pod_step.py recompiles it against the record (5 %)


@dataclasses.dataclass(frozen=True)
class PodTable:
    config: str
    header: Tuple[str, ...]      # headers of the leading cells
    rows: Tuple[PodRow, ...]
    cited_header: Tuple[str, ...] = ()

    def command_lines(self) -> List[str]:
        return [f"recloss-train {self.config} {' '.join(r.overrides)}" for r in self.rows]


_V6E = ("compile_topology=v6e-8",)
_FSDP8 = ("ici_data_parallelism=1", "ici_fsdp_parallelism=8")
_V5E = ("compile_topology=v5e-256", "global_batch_size=1024")
POD_TABLES: Dict[str, PodTable] = {
    "pod-paper": PodTable("configs/sasrec_yambda.yml", ("loss", "mesh (data, fsdp, vocab)"), (
        PodRow("v6e-8 paper step, dense_bce", ("`dense_bce`", "(8, 1, 1)"), ("loss=dense_bce", *_V6E),
               ("22.37 GiB (Keras BCE)",)),
        PodRow("v6e-8 paper step, data parallel", ("`cutbce_pallas`", "(8, 1, 1)"), ("loss=cutbce_pallas", *_V6E),
               ("7.67 GiB (CutBCE)",), pinned=True),
        PodRow("v6e-8 paper step, fsdp 8", ("`cutbce_pallas`", "(1, 8, 1), table sharded over fsdp"),
               ("loss=cutbce_pallas", *_V6E, *_FSDP8), ("–",)),
        PodRow("v6e-8 paper step, fsdp 8 ring", ("`cutbce_pallas`, `loss_fsdp_gather=ring`",
                                                 "(1, 8, 1), table sharded over fsdp"),
               ("loss=cutbce_pallas", *_V6E, *_FSDP8, "loss_fsdp_gather=ring"), ("–",), pinned=True),
        PodRow("v6e-8 paper step, fsdp 8 rows", ("`cutbce_pallas`, `loss_fsdp_gather=rows`",
                                                 "(1, 8, 1), table sharded over fsdp"),
               ("loss=cutbce_pallas", *_V6E, *_FSDP8, "loss_fsdp_gather=rows"), ("–",)),
        PodRow("v6e-8 paper step, vocab 8", ("`cutbce_pallas`", "(1, 1, 8), table over 8 vocab shards"),
               ("loss=cutbce_pallas", *_V6E, "ici_data_parallelism=1", "ici_vocab_parallelism=8"), ("–",),
               pinned=True),
        PodRow("v6e-8 paper step, batch 1024", ("`cutbce_pallas`, global batch **1024**", "(8, 1, 1)"),
               ("loss=cutbce_pallas", *_V6E, "global_batch_size=1024"), ("OOM for BCE at 128",)),
    ), ("paper (measured on TPU)",)),
    "pod-v5e": PodTable("configs/sasrec_yambda.yml", ("table", "mesh (data, fsdp, vocab)"), (
        PodRow("v5e-256 V=1e7, vocab 8", ("V = 10^7", "data 32 × vocab 8"),
               ("loss=cutbce_pallas", *_V5E, "vocab_size=10000000", "ici_data_parallelism=32",
                "ici_vocab_parallelism=8"), pinned=True),
        PodRow("v5e-256 V=1e7, fsdp 8 ring", ("V = 10^7", "data 32 × fsdp 8, `loss_fsdp_gather=ring`"),
               ("loss=cutbce_pallas", *_V5E, "vocab_size=10000000", "ici_data_parallelism=32",
                "ici_fsdp_parallelism=8", "loss_fsdp_gather=ring"), pinned=True),
        PodRow("v5e-256 V=1e7, fsdp 8 rows", ("V = 10^7", "data 32 × fsdp 8, `loss_fsdp_gather=rows`"),
               ("loss=cutbce_pallas", *_V5E, "vocab_size=10000000", "ici_data_parallelism=32",
                "ici_fsdp_parallelism=8", "loss_fsdp_gather=rows"), pinned=True),
        PodRow("v5e-256 V=1e8, vocab 64", ("V = 10^8", "data 4 × vocab 64"),
               ("loss=cutbce_pallas", *_V5E, "vocab_size=100000000", "ici_data_parallelism=4",
                "ici_vocab_parallelism=64"), pinned=True),
        # configs/sasrec_billion.yml: the table in bfloat16 on row-wise AdaGrad, over all 256 chips.
        PodRow("v5e-256 V=1e9, vocab 256", ("V = 10^9, bfloat16 table, row-wise AdaGrad", "vocab 256"),
               ("loss=cutbce_pallas", *_V5E, "vocab_size=1000000000", "ici_data_parallelism=1",
                "ici_vocab_parallelism=256", "item_optimizer=rowwise_adagrad", "item_learning_rate=0.03",
                "item_table_dtype=bfloat16"), pinned=True),
    )),
}


def pod_rows() -> Dict[str, Tuple[str, PodRow]]:
    """{row name: (config, row)} over every pod table."""
    return {r.name: (t.config, r) for t in POD_TABLES.values() for r in t.rows}


def pod_key(config: str, overrides: Sequence[str]) -> Tuple[str, Tuple[str, ...]]:
    return config, tuple(overrides)


def load_pod(path: Path) -> Tuple[dict, Dict[Tuple, dict]]:
    """(stack, {pod_key: recorded row}) of a pod record file (`load`'s format: stack + rows)."""
    data = load(path)
    return data["stack"], {pod_key(r["config"], r["overrides"]): r for r in data["rows"]}


def record_pod(rows: Sequence[dict], records_dir, stack: Optional[dict] = None) -> Tuple[Path, int, int]:
    """Merges pod-step ``rows`` ({config, overrides, *_bytes, ...}) into this stack's file under
    ``records_dir``, a row of the same (config, overrides) replaced in place. Returns (path, replaced, added)."""
    stack = current_stack() if stack is None else stack
    with _locked(Path(records_dir)):
        path = Path(records_dir) / f"{stack_id(stack)}.json"
        return _merge(path, stack, rows, lambda r: pod_key(r["config"], r["overrides"]),
                      ("config", "overrides", "hbm_bytes", "temp_bytes"))


def render_pod_table(name: str, stacks: Sequence[str], records_dir: Optional[Path] = None) -> str:
    """The block of pod table ``name``: a column of per-chip HBM per record ``stacks`` (file stems)."""
    table = POD_TABLES[name]
    base = Path(POD_DIR if records_dir is None else records_dir)
    gib = lambda b: f"{b / 2**30:.2f}"
    columns, heads = [], []
    for stack in stacks:
        path = base / f"{stack}.json"
        st, by = load_pod(path)
        heads.append(f"jax {st['jax']}, libtpu {st['libtpu']} (Python {st['python'].rsplit('.', 1)[0]})")
        cells = []
        for row in table.rows:
            rec = by.get(pod_key(table.config, row.overrides))
            if rec is None:
                raise RecordError(f"{path} has no row {row.name!r} of table {name} "
                                  f"({table.config} {' '.join(row.overrides)}): record it on that stack "
                                  f"with `{POD_RECORD}`")
            cells.append(f"{gib(rec['hbm_bytes'])} GiB (temporaries {gib(rec['temp_bytes'])})")
        columns.append(cells)
    rels = ", ".join(f"[`{s}.json`](docs/figures/pod/{s}.json)" for s in stacks)
    header = [*table.header, *(f"per-chip HBM, {h}" for h in heads), *table.cited_header]
    lines = ["```sh", *table.command_lines(),
             f"{POD_MAKE}   # records every row above on both legs ({POD_RECORD} on one venv)", "```", "",
             f"Recorded in {rels}:", "",
             "| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for i, row in enumerate(table.rows):
        lines.append("| " + " | ".join([*row.cells, *(c[i] for c in columns), *row.cited]) + " |")
    return "\n".join(lines)


_CPU_BLOCK = re.compile(r"(?P<start><!-- figures:(?P<name>[\w.-]+) cpu -->\n)(?P<body>.*?)"
                        r"(?P<end><!-- /figures:(?P=name) -->)", re.S)

_POD_BLOCK = re.compile(r"(?P<start><!-- figures:(?P<name>[\w.-]+) pod=(?P<stacks>[\w.+,-]+) -->\n)(?P<body>.*?)"
                        r"(?P<end><!-- /figures:(?P=name) -->)", re.S)

# A block's body (empty as committed in docs/, rendered in README.md) lies between its two marker lines.
_BLOCK = re.compile(r"<!-- figures:(?P<name>[\w.-]+) stack=(?P<stack>[\w.+-]+) -->\n(?P<body>.*?)"
                    r"(?P<end><!-- /figures:(?P=name) -->)", re.S)


def render_readme(text: str, records_dir: Optional[Path] = None, stacks: Optional[Dict[str, str]] = None,
                  figures_dir: Optional[Path] = None) -> str:
    """``text`` with every marked block re-rendered: ``<!-- figures:NAME stack=STACK -->`` from the
    per-chip HBM records (``records_dir``, default ``<figures_dir>/hbm``; ``stacks``: {name: stack}
    overrides the markers'), ``<!-- figures:NAME cpu -->`` from ``<figures_dir>/<file>`` (default docs/figures),
    ``<!-- figures:NAME pod=STACK,STACK -->`` from ``<figures_dir>/pod/STACK.json``, one column per stack."""
    stacks = dict(stacks or {})
    seen = set()

    def sub(m):
        name = m.group("name")
        if name not in TABLES:
            raise RecordError(f"README block figures:{name} names no table (known: {', '.join(TABLES)})")
        seen.add(name)
        stack = stacks.get(name, m.group("stack"))
        return (f"<!-- figures:{name} stack={stack} -->\n" + render_table(name, stack, records_dir)
                + "\n" + m.group("end"))

    def sub_cpu(m):
        name = m.group("name")
        if name in CPU_RUNS:
            return m.group("start") + render_cpu_runs(name, figures_dir) + "\n" + m.group("end")
        if name in CHIP_RECORDS:
            return m.group("start") + render_chip_record(name, figures_dir) + "\n" + m.group("end")
        if name not in CPU_TABLES:
            raise RecordError(f"block figures:{name} cpu names no CPU table "
                              f"(known: {', '.join([*CPU_TABLES, *CPU_RUNS, *CHIP_RECORDS])})")
        return m.group("start") + render_cpu_table(name, figures_dir) + "\n" + m.group("end")

    def sub_pod(m):
        name = m.group("name")
        if name not in POD_TABLES:
            raise RecordError(f"block figures:{name} pod=... names no pod table (known: {', '.join(POD_TABLES)})")
        pod_dir = None if figures_dir is None else Path(figures_dir) / "pod"
        return m.group("start") + render_pod_table(name, m.group("stacks").split(","), pod_dir) + "\n" + m.group("end")

    if records_dir is None and figures_dir is not None:
        records_dir = Path(figures_dir) / "hbm"
    out = _POD_BLOCK.sub(sub_pod, _CPU_BLOCK.sub(sub_cpu, _BLOCK.sub(sub, text)))
    unknown = set(stacks) - seen
    if unknown:
        raise RecordError(f"README has no figures block {', '.join(sorted(unknown))}")
    return out


# ----------------------------------------------------------------------------- the guard
@dataclasses.dataclass(frozen=True)
class Guarded:
    """A row the guard recompiles: (topology, strategy, B, N, D, V) at L=8, float32, options {}."""
    topology: str
    strategy: str
    B: int
    N: int
    D: int
    V: int
    why: str

    @property
    def objective(self) -> str:
        import recloss
        return "softmax" if self.strategy.startswith("tokamax:") else recloss.get_strategy(self.strategy).objective

    def key(self) -> Tuple:
        return row_key(dict(topology=self.topology, objective=self.objective, strategy=self.strategy, B=self.B,
                            N=self.N, D=self.D, V=self.V, L=8, dtype="float32", options={}))


GUARD_ROWS = (
    Guarded("v6e-8", "cutbce_pallas", 8, 256, 256, 876_939, "the paper's Table III loss on one v6e chip"),
    Guarded("v6e-8", "cutbce_pallas", 128, 128, 128, 876_939,
            "16,384 rows: the correction gradient's row-chunked scan (its f32 [V, D] carry)"),
    Guarded("v6e-8", "cutbce", 32, 128, 128, 876_939, "the pure-JAX sweep and its emitted dE blocks"),
    Guarded("v6e-8", "cutce_pallas", 128, 128, 128, 876_939, "the softmax kernels at 16,384 rows"),
)


def _this_venv() -> str:
    prefix = Path(sys.prefix).resolve()
    try:
        return str(prefix.relative_to(ROOT))
    except ValueError:
        return str(prefix)


def recording_commands(rows=GUARD_ROWS) -> List[str]:
    """The commands, on this venv, that record ``rows`` (those of the README tables they belong to)."""
    cmds = []
    for t in TABLES.values():
        if any(g.topology == t.topology and g.objective == t.objective for g in rows):
            cmds.append(f"{ENV} {_this_venv()}/bin/python -m tools.hbm_figures {t.argv} --record docs/figures/hbm")
    return cmds


def guarded_records(stack: Optional[dict] = None, records_dir: Optional[Path] = None) -> Dict[Guarded, dict]:
    """The stored row of each `GUARD_ROWS` entry for ``stack`` (default: this one), or RecordError
    saying which command records them."""
    stack = current_stack() if stack is None else stack
    path = record_file(stack, records_dir)
    how = ("record it on this venv: " + "; ".join(recording_commands())
           + " (`make figures` records both legs), and commit the file")
    if not path.exists():
        raise RecordError(f"no per-chip HBM record for this stack (jax {stack['jax']}, libtpu "
                          f"{stack['libtpu']}): {path} does not exist; {how}")
    data = load(path)
    by_key = {row_key(r): r for r in data["rows"]}
    missing = [g for g in GUARD_ROWS if g.key() not in by_key]
    if missing:
        raise RecordError(f"{path} has no row for " + ", ".join(
            f"{g.strategy} {(g.B, g.N, g.D, g.V)} on {g.topology}" for g in missing) + f"; {how}")
    return {g: by_key[g.key()] for g in GUARD_ROWS}


def compile_guarded(rows=GUARD_ROWS) -> Dict[Guarded, dict]:
    """Recompiles each guarded row, as `recloss-bench --topology` does."""
    from recloss.bench import topology
    out = {}
    for g in rows:
        (row,) = topology.topology_rows(g.topology, [g.strategy], [topology.Shape(g.B, g.N, g.D, g.V)])
        out[g] = row
    return out


def compare(measured: Dict[Guarded, dict], stored: Dict[Guarded, dict],
            tolerance: float = TOLERANCE) -> Tuple[List[str], List[str]]:
    """(report lines, failures): a failure where temp or total HBM is more than ``tolerance`` above
    the stored figure, or a stored figure compiled and the new one does not."""
    lines, failures = [], []
    mib = lambda x: f"{x / 2**20:,.1f} MiB" if isinstance(x, (int, float)) else str(x)
    for g, new in measured.items():
        old = stored[g]
        for field, label in (("temp_bytes", "temp"), ("hbm_bytes", "total")):
            a, b = old[field], new[field]
            where = f"{g.strategy} {(g.B, g.N, g.D, g.V)} on {g.topology} {label}"
            if not isinstance(a, (int, float)):
                line = f"{where}: stored {a}, now {mib(b)}"
                bad = False
            elif not isinstance(b, (int, float)):
                line = f"{where}: stored {mib(a)}, now {b}"
                bad = True
            else:
                ratio = b / a if a else (1.0 if b == 0 else float("inf"))
                line = f"{where}: stored {mib(a)}, now {mib(b)} ({ratio:.3f}x)"
                bad = b > a * (1 + tolerance)
            lines.append(("FAIL " if bad else "ok   ") + line)
            if bad:
                failures.append(line + f" > {1 + tolerance:.2f}x the stored figure")
    return lines, failures


# ----------------------------------------------------------------------------- command line
def config_parser(doc: str) -> argparse.ArgumentParser:
    """The parser of a recorder that trains a recloss-train config: its positional ``config`` (a YAML
    file, default configs/base.yml, and key=value overrides)."""
    p = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("config", nargs="*", help="a YAML config (default configs/base.yml) and key=value overrides")
    return p


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tools.figures", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--check", action="store_true",
                        help="do not write: exit 1 when README.md is not what the records render")
    parser.add_argument("--readme", default=str(README), help="the README to render (default: %(default)s)")
    parser.add_argument("--records", default=str(RECORDS_DIR), help="the record files (default: %(default)s)")
    parser.add_argument("--stack", action="append", default=[], metavar="NAME=STACK",
                        help="render block NAME from record STACK (e.g. v6e-softmax=jax-0.12.0.1_libtpu-0.0.50.1) "
                             "instead of the stack its marker names; repeatable")
    args = parser.parse_args(argv)
    stacks = {}
    for item in args.stack:
        name, sep, stack = item.partition("=")
        if not sep or name not in TABLES or not stack:
            parser.error(f"--stack {item!r} is not NAME=STACK with NAME one of {', '.join(TABLES)}")
        stacks[name] = stack
    readme = Path(args.readme)
    try:
        text = readme.read_text()
    except OSError as err:
        parser.error(f"--readme {readme}: {err.strerror or err}")
    try:
        new = render_readme(text, Path(args.records), stacks)
    except RecordError as err:
        print(f"figures: {err}", file=sys.stderr)
        return 2
    return write_rendered(readme, text, new, args.check, "python -m tools.figures")


def write_rendered(readme: Path, text: str, new: str, check: bool, command: str) -> int:
    """Writes ``new`` over ``readme`` (whose text is ``text``) unless it is the same; with ``check``,
    writes nothing and prints the difference. 0 when up to date or written, 1 when ``check`` finds a
    difference (``command`` is what renders it)."""
    if new == text:
        print(f"figures: {readme} is up to date", file=sys.stderr)
        return 0
    if check:
        import difflib
        sys.stderr.writelines(difflib.unified_diff(text.splitlines(True), new.splitlines(True),
                                                   str(readme), "rendered from the results files", n=1))
        print(f"figures: {readme} differs from what its results files render: run {command}", file=sys.stderr)
        return 1
    readme.write_text(new)
    print(f"figures: rendered {readme}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
