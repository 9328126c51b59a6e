"""``recloss-train --table3``: the paper's Table III (SASRec's training speed and memory) on the chip it
runs on, one row at a time, with each row's step taken apart. It refuses any backend but a TPU.

A row is the paper's model (`configs/sasrec_yambda.yml`: 3 layers, D = 256, 8 labels) on synthetic data
at a vocabulary V, a per-chip batch b and a sequence length N, with one loss strategy and one table mode:
``f32-adamw`` (float32 tables, AdamW as the rest of the model) or ``bf16-adagrad`` (bfloat16 tables,
row-wise AdaGrad). For each row:

- **steps/s**: `recloss_plugins.sasrec.train.train` runs ``--steps`` steps logging every ``--window``;
  the median of the logged windows' steps/s after the first (which holds the compile) is the figure a
  user sees in their own run (input pipeline and host included);
- **memory**: the train step compiled for this chip: per-chip bytes by `memory_analysis` (arguments +
  outputs + temporaries − aliased) and by XLA's own count (`recloss.aot.hbm_bytes`); a step that does not
  fit gives the compiler's words instead, and the row's other figures are absent;
- **parts** (timed, medians of ``--rounds`` interleaved rounds of `CHAINED_CALLS` calls dispatched back
  to back, as the training loop dispatches its steps; each program compiled on its own): the
  compiled train step alone on one batch ("device step"), the loss's forward and backward (the strategy
  on the model's hidden states, its table and bias), the rest of the model's forward and backward (its
  parameters' gradients through a stand-in loss ⟨hidden, C⟩ for a fixed random C), and the optimizer
  update (the step's own ``tx.update`` and `optim.apply_updates`). ``parts_sum`` is the sum of the three
  parts, which `check_parts` holds to the device step.

The record is JSON ({info, rows}); rows merge into an existing file by key, so a run of some rows
updates only those. `format_table` renders it as Markdown with the paper's own figures beside ours, and
refuses a record that misses a row of the grid or holds a stale one (`record_problems`).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import re
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Callable, Dict, List, Optional, Sequence

PAPER_V = 876_939
SMALL_V = 131_072
TABLES = {
    "f32-adamw": ("item_table_dtype=float32", "item_optimizer=adamw"),
    "bf16-adagrad": ("item_table_dtype=bfloat16", "item_optimizer=rowwise_adagrad", "item_learning_rate=0.03"),
}
STRATEGIES = ("dense_bce", "cutbce", "cutbce_pallas", "cutce_pallas")
PARTS_TOLERANCE = 0.10     # the parts' sum within 10 % of the device step
PAPER_CONFIG = Path(__file__).resolve().parents[2] / "configs" / "sasrec_yambda.yml"


@dataclasses.dataclass(frozen=True)
class Row:
    vocab: int
    batch: int       # per chip
    seq: int
    loss: str
    tables: str      # a key of TABLES

    @property
    def at_papers_point(self) -> bool:
        """The paper's own V, per-chip batch 8 and N = 256 (where its text gives steps/s)."""
        return self.vocab == PAPER_V and self.batch == 8 and self.seq == 256

    @property
    def key(self) -> str:
        return f"V={self.vocab} b={self.batch} N={self.seq} {self.loss} {self.tables}"

    def overrides(self, chips: int = 1) -> List[str]:
        return [f"vocab_size={self.vocab}", f"synthetic_num_items={self.vocab - 1}",
                f"global_batch_size={self.batch * chips}", f"max_seq_len={self.seq}", f"loss={self.loss}",
                *TABLES[self.tables]]


def paper_rows() -> List[Row]:
    """Table III's grid: V = 876,939 at per-chip batch 8 and 16 and N = 256 and 512, every strategy and
    table mode; and V = 131,072 at batch 8, N = 256, where the dense loss's logits fit beside the rest."""
    rows = [Row(PAPER_V, b, n, s, t) for b in (8, 16) for n in (256, 512) for s in STRATEGIES for t in TABLES]
    rows += [Row(SMALL_V, 8, 256, s, t) for s in STRATEGIES for t in TABLES]
    return rows


def select(rows: Sequence[Row], pattern: Optional[str]) -> List[Row]:
    """The rows whose key contains every comma-separated part of ``pattern`` (all rows for None)."""
    if not pattern:
        return list(rows)
    parts = [p.strip() for p in pattern.split(",") if p.strip()]
    chosen = [r for r in rows if all(p in r.key for p in parts)]
    if not chosen:
        raise ValueError(f"--rows {pattern!r} matches no row: keys look like {rows[0].key!r}")
    return chosen


_SPS = re.compile(r"\|\s*([0-9.]+) steps/s\s*\|")


def window_rates(lines: Sequence[str]) -> List[float]:
    """steps/s of each logged window, in order, from the trainer's log lines."""
    return [float(m.group(1)) for line in lines for m in [_SPS.search(line)] if m]


def median_after_first(rates: Sequence[float]) -> Optional[float]:
    """The median of the windows after the first (which holds the compile); None with fewer than two."""
    return statistics.median(rates[1:]) if len(rates) >= 2 else None


def check_parts(parts: Dict[str, float], tolerance: float = PARTS_TOLERANCE) -> Optional[str]:
    """None when loss + model + optimizer is within ``tolerance`` of the device step, else what is off."""
    total = parts["loss_ms"] + parts["model_ms"] + parts["optimizer_ms"]
    ratio = total / parts["device_step_ms"]
    if abs(ratio - 1.0) <= tolerance:
        return None
    return (f"the parts add to {total:.2f} ms, {ratio:.2f}x the device step's {parts['device_step_ms']:.2f} ms "
            f"(within {tolerance:.0%} expected)")


def _config(row: Row, base: str, extra: Sequence[str], chips: int):
    from recloss_plugins.config import load_config
    return load_config([base, "dataset_type=synthetic", "enable_checkpointing=false",
                        "enable_tensorboard=false", "eval_interval=0", *row.overrides(chips), *extra])


def memory(cfg, devices):
    """(figures, Program): the train step compiled for ``devices`` in the Program `train` then reuses
    (one compile a row); figures {'hbm_bytes', 'xla_bytes', 'temp_bytes'} or, past the chip's memory,
    {'error'} (and no Program)."""
    from recloss import aot
    from recloss_plugins.sasrec import aot as step_aot, parallel
    from recloss_plugins.sasrec.program import program_for

    program = program_for(cfg, parallel.build_mesh(cfg, devices), cfg.vocab_size)
    with tempfile.TemporaryDirectory(prefix="recloss-table3-") as dump:
        try:
            compiled = program.compiled_train_step(compiler_options=aot.dump_options(dump))
        except Exception as err:  # noqa: BLE001 - a dense step past the chip's HBM is a result
            oom = step_aot.compile_oom(err)
            if oom is None:
                raise
            return dict(error=oom), None
        xla = aot.hbm_bytes(dump) if devices[0].platform == "tpu" else None   # off TPU XLA counts no HBM
    rep = aot.memory_report(compiled)
    return dict(hbm_bytes=int(rep["total"]), temp_bytes=int(rep["temp"]), xla_bytes=xla), program


# Calls a part's timing chains before it waits for the last: the training loop dispatches steps ahead of
# the device, so its steps/s holds no host round trip, and neither should a part (one call waited on alone
# adds ~0.8-0.9 ms on a v5e: a row's device step then exceeded 1/steps/s by that much, and the three
# parts' sum the step by 12-43 % on 8 December).
CHAINED_CALLS = 8


def _chained_ms(fn: Callable, calls: int = CHAINED_CALLS) -> float:
    """ms a call of ``fn`` over ``calls`` calls dispatched back to back, the last one waited on."""
    import jax
    t0 = time.perf_counter()
    out = None
    for _ in range(calls):
        out = fn()
    jax.block_until_ready(out)
    return 1e3 * (time.perf_counter() - t0) / calls


def parts(program, state, rounds: int, seed: int = 0) -> Dict[str, float]:
    """The device step and its three parts at ``program``'s shapes and ``state``'s values (ms): medians of
    ``rounds`` interleaved rounds, each round's figure a call's share of `CHAINED_CALLS` chained calls."""
    import jax
    import jax.numpy as jnp
    import numpy as np
    from flax import nnx

    from recloss_plugins.sasrec import optim

    cfg = program.cfg
    rng = np.random.default_rng(seed)
    b, n, l = program.batch_size, cfg.max_seq_len, cfg.num_labels
    shard = lambda x, sh: jax.device_put(x, sh)
    batch = {"inputs": shard(rng.integers(1, program.vocab_size, (b, n), dtype=np.int32),
                             program.batch_shardings["inputs"]),
             "targets": shard(rng.integers(1, program.vocab_size, (b, n, l), dtype=np.int32),
                              program.batch_shardings["targets"]),
             "weights": shard(np.ones((b, n), np.float32), program.batch_shardings["weights"])}
    inputs = program.step_inputs()
    step = program.compiled_train_step()
    params = state["params"]
    model = nnx.merge(program.graphdef, params)
    hidden = jax.jit(lambda p, x: nnx.merge(program.graphdef, p)(x))(params, batch["inputs"])
    table, bias = model.output_table(), model.output_bias()
    ct = jnp.asarray(rng.normal(size=hidden.shape), hidden.dtype)
    layout = program.layout if program.manual is None else program.manual

    loss = jax.jit(jax.value_and_grad(
        lambda h, e, bb: program.strategy(h, e, batch["targets"], batch["weights"], bb, layout=layout).loss,
        argnums=(0, 1) if bias is None else (0, 1, 2)))
    rest = jax.jit(jax.value_and_grad(
        lambda p: jnp.vdot(nnx.merge(program.graphdef, p)(batch["inputs"]).astype(jnp.float32),
                           ct.astype(jnp.float32))))
    grads = jax.tree.map(jnp.zeros_like, params)

    @jax.jit
    def update(g, opt_state, p, key):
        updates, new_opt = program.tx.update(g, opt_state, p)
        return optim.apply_updates(p, updates, key), new_opt

    key = jax.random.key(seed)
    # The step donates its state: it runs on a copy of its own, threaded from call to call.
    held = {"state": jax.tree.map(jnp.copy, state)}

    def device_step():
        held["state"], metrics = step(held["state"], batch, inputs)
        return metrics

    fns = {"device_step_ms": device_step,
           "loss_ms": lambda: loss(hidden, table, bias),
           "model_ms": lambda: rest(params),
           "optimizer_ms": lambda: update(grads, state["opt_state"], params, key)}
    for fn in fns.values():     # compile and warm each
        jax.block_until_ready(fn())
    times: Dict[str, List[float]] = {k: [] for k in fns}
    order = np.random.default_rng(seed)
    names = list(fns)
    for _ in range(rounds):
        for i in order.permutation(len(names)):
            times[names[i]].append(_chained_ms(fns[names[i]]))
    return {k: round(statistics.median(v), 3) for k, v in times.items()}


def measure(row: Row, base: str, *, steps: int, window: int, rounds: int, extra: Sequence[str] = (),
            devices=None, log=print, out_dir: Optional[str] = None) -> dict:
    """One row's record (see the module docstring)."""
    import jax

    from recloss_plugins.sasrec.train import train

    devices = list(jax.devices()[:1] if devices is None else devices)
    rec = dict(key=row.key, **dataclasses.asdict(row), overrides=row.overrides(), steps=steps, window=window)
    t0 = time.perf_counter()
    lines: List[str] = []
    with tempfile.TemporaryDirectory(prefix="recloss-table3-run-") as tmp:
        cfg = _config(row, base, [f"steps={steps}", f"log_period={window}", f"base_output_directory={out_dir or tmp}",
                                  "run_name=table3", *extra], len(devices))
        figures, program = memory(cfg, devices)
        rec.update(figures)
        if "error" in rec:
            log(f"[table3] {row.key}: does not fit: {rec['error']}")
            return rec
        result = train(cfg, devices=devices, log=lines.append)
    rec["compiles"] = 1 if result.program is program else 2     # `train` reused the step compiled above
    rates = window_rates(lines)
    rec.update(windows=[round(r, 3) for r in rates], steps_per_sec=median_after_first(rates))
    rec.update(parts(result.program, result.state, rounds))
    rec["parts_sum_ms"] = round(rec["loss_ms"] + rec["model_ms"] + rec["optimizer_ms"], 3)
    rec["parts_check"] = check_parts(rec)
    rec["parts_calls"] = CHAINED_CALLS
    rec["wall_s"] = round(time.perf_counter() - t0, 1)
    xla = "-" if rec["xla_bytes"] is None else f"{rec['xla_bytes'] / 2**30:.2f}"
    log(f"[table3] {row.key}: {rec['steps_per_sec']} steps/s, {rec['hbm_bytes'] / 2**30:.2f} GiB (XLA {xla}); "
        f"step {rec['device_step_ms']} ms = loss {rec['loss_ms']} + model {rec['model_ms']} + optimizer "
        f"{rec['optimizer_ms']} ({rec['parts_sum_ms']} ms) in {rec['wall_s']} s")
    return rec


def merge(path: Path, info: dict, rows: Sequence[dict]) -> dict:
    """``rows`` merged into the record at ``path`` by key (a row of the same key replaced in place)."""
    data = json.loads(path.read_text()) if path.exists() else dict(info=info, rows=[])
    by_key = {r["key"]: i for i, r in enumerate(data["rows"])}
    for r in rows:
        if r["key"] in by_key:
            data["rows"][by_key[r["key"]]] = r
        else:
            data["rows"].append(r)
    data["info"] = info
    path.write_text(json.dumps(data, indent=1) + "\n")
    return data


# The paper's own figures (its Table III's text: SASRec on Yambda-50M, float32 and AdamW, an 8-chip TPU v6e
# slice of 32 GiB a chip, data parallel): per-chip batch 8 and N = 256 for both losses; at batch 16 or
# N = 512 its dense BCE ran out of memory and CutBCE took 7.89-8.94 GiB a chip (no speed given).
PAPER_CHIP = "TPU v6e-8 (32 GiB a chip)"


def paper_figure(row: Row) -> str:
    """The paper's figure for ``row`` ('' where it gives none: other table modes, the small vocabulary,
    the softmax loss)."""
    if row.vocab != PAPER_V or row.tables != "f32-adamw" or row.loss == "cutce_pallas":
        return ""
    first = row.at_papers_point
    if row.loss == "dense_bce":
        return "6.14 steps/s, 22.37 GiB" if first else "out of memory"
    return "20.01 steps/s, 7.67 GiB" if first else "7.89–8.94 GiB"


def record_problems(payload: dict, grid: Optional[Sequence[Row]] = None) -> List[str]:
    """What keeps the record ``payload`` ({info, rows}) from rendering the grid (`paper_rows`): a row of
    the grid not recorded, a recorded row the grid no longer has, or one recorded with other overrides
    than its row's today (stale), or one with neither steps/s nor the compiler's error."""
    grid = list(paper_rows() if grid is None else grid)
    want = {r.key: r for r in grid}
    have = {r.get("key"): r for r in payload.get("rows", [])}
    out = [f"{k}: not recorded" for k in want if k not in have]
    for k, rec in have.items():
        if k not in want:
            out.append(f"{k}: recorded, but not a row of the grid any more (stale)")
        elif rec.get("overrides") != want[k].overrides():
            out.append(f"{k}: recorded with overrides {rec.get('overrides')}, the row's are {want[k].overrides()} "
                       f"(stale)")
        elif rec.get("steps_per_sec") is None and not rec.get("error"):
            out.append(f"{k}: recorded without steps/s or the compiler's error")
    return out


def _gib(n) -> str:
    return "–" if n is None else f"{n / 2**30:.2f}"


def _renderable(payload: dict, grid: Optional[Sequence[Row]]):
    """(grid, info, {key: row}) of a record that renders ``grid`` (default `paper_rows`); raises ValueError
    naming every `record_problems` entry and the command that writes the record."""
    grid = list(paper_rows() if grid is None else grid)
    problems = record_problems(payload, grid)
    if problems:
        raise ValueError("the Table III record cannot render: " + "; ".join(problems)
                         + ". Record the rows on a TPU host with `recloss-train --table3 --json FILE --rows ...`")
    return grid, payload.get("info", {}), {r["key"]: r for r in payload["rows"]}


def format_table(payload: dict, grid: Optional[Sequence[Row]] = None) -> str:
    """The record as a Markdown table in the grid's order, the paper's figure beside each row it gives
    one for, and the compiler's words under it for a row that does not fit. Raises ValueError naming every
    `record_problems` entry (and the command that writes the record)."""
    grid, info, have = _renderable(payload, grid)
    lines = [f"{info.get('device', 'TPU')}, jax {info.get('jax', '?')}, libtpu {info.get('libtpu', '?')}, "
             f"{info.get('date', '?')}: {info.get('steps', '?')} steps a row, steps/s the median of the "
             f"{info.get('window', '?')}-step windows after the first; the parts are medians of "
             f"{info.get('rounds', '?')} interleaved rounds{_parts_timing(payload['rows'])}; parts ÷ step is "
             f"their sum over the device step (marked where it is off by more than {PARTS_TOLERANCE:.0%}).", "",
             "| V | batch a chip | N | loss | tables | steps/s | GiB a chip (memory_analysis / XLA) "
             "| step ms | loss ms | model ms | optimizer ms | parts ÷ step | the paper, " + PAPER_CHIP + " |",
             "|---:|---:|---:|---|---|---:|---:|---:|---:|---:|---:|---:|---|"]
    errors = []
    for row in grid:
        rec = have[row.key]
        if rec.get("error"):
            errors.append(f"- V = {row.vocab:,}, batch {row.batch}, N = {row.seq}, {row.loss}, {row.tables}: "
                          f"{rec['error']}")
            cells = ["does not fit", "–", "–", "–", "–", "–", "–"]
        else:
            ratio = rec["parts_sum_ms"] / rec["device_step_ms"]
            cells = [f"{rec['steps_per_sec']:.1f}", f"{_gib(rec.get('hbm_bytes'))} / {_gib(rec.get('xla_bytes'))}",
                     *(f"{rec[k]:.2f}" for k in ("device_step_ms", "loss_ms", "model_ms", "optimizer_ms")),
                     f"{ratio:.2f}×" + (" (off)" if rec.get("parts_check") else "")]
        lines.append(f"| {row.vocab:,} | {row.batch} | {row.seq} | `{row.loss}` | {row.tables} | "
                     + " | ".join(cells) + f" | {paper_figure(row)} |")
    if errors:
        lines += ["", "Rows that do not fit, in the compiler's words:", "", *errors]
    return "\n".join(lines)


def _parts_timing(rows) -> str:
    """How the record's parts were timed: rows before `CHAINED_CALLS` waited on each call alone."""
    calls = {r.get("parts_calls") for r in rows if not r.get("error")}
    if calls == {None}:
        return ", each call waited on alone (host round trip included)"
    if None in calls:
        return ", some rows' calls waited on alone (host round trip included), the rest chained"
    return f", each a call's share of {'/'.join(str(c) for c in sorted(calls))} chained calls"


def format_short(payload: dict, grid: Optional[Sequence[Row]] = None) -> str:
    """The README's short version of `format_table`: steps/s and GiB a chip (XLA's count) by loss and table
    mode at the paper's V, batch 8, N = 256, with the paper's figures. Refuses what `format_table` refuses."""
    grid, info, have = _renderable(payload, grid)
    lines = [f"SASRec (the paper's model: 3 layers, D = 256, N = 256, batch 8) at V = {PAPER_V:,} on one "
             f"{info.get('device', 'TPU')} ({info.get('date', '?')}), the paper's {PAPER_CHIP} beside it:", "",
             "| loss | tables | steps/s | GiB a chip | the paper |", "|---|---|---:|---:|---|"]
    for row in filter(lambda r: r.at_papers_point, grid):
        rec = have[row.key]
        cells = (["does not fit", "–"] if rec.get("error")
                 else [f"{rec['steps_per_sec']:.1f}", _gib(rec.get("xla_bytes") or rec.get("hbm_bytes"))])
        lines.append(f"| `{row.loss}` | {row.tables} | " + " | ".join(cells) + f" | {paper_figure(row)} |")
    return "\n".join(lines)


def command_line() -> argparse.ArgumentParser:
    """The command line of ``recloss-train --table3`` (after that flag)."""
    parser = argparse.ArgumentParser(prog="recloss-train --table3", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--json", required=True, help="the record to write (rows merge in by key)")
    parser.add_argument("--rows", default=None,
                        help="comma-separated parts every chosen row's key contains, e.g. 'V=876939,b=8 ,cutbce_pallas'"
                             " (default: every row of Table III's grid)")
    parser.add_argument("--config", default=None, help="the base config (default configs/sasrec_yambda.yml)")
    parser.add_argument("--steps", type=int, default=200, help="steps each row trains (default %(default)s)")
    parser.add_argument("--window", type=int, default=25, help="steps a logged window (default %(default)s)")
    parser.add_argument("--rounds", type=int, default=7, help="interleaved rounds of the parts (default %(default)s)")
    parser.add_argument("--allow-cpu", action="store_true", help=argparse.SUPPRESS)   # the tests' tiny rows
    parser.add_argument("overrides", nargs="*", help="key=value overrides for every row (e.g. synthetic_num_users=2000)")
    return parser


def main(argv=None) -> int:
    parser = command_line()
    args = parser.parse_args(argv)
    import jax

    from recloss import aot

    if jax.default_backend() != "tpu" and not args.allow_cpu:
        print(f"recloss-train --table3 measures a TPU; JAX's backend here is {jax.default_backend()!r}",
              file=sys.stderr)
        return 2
    if args.steps < 2 * args.window:
        parser.error(f"--steps {args.steps} must be at least two windows of --window {args.window}: the first "
                     f"holds the compile")
    base = args.config or str(PAPER_CONFIG)
    if not Path(base).is_file():
        parser.error(f"no config at {base}: pass --config (the paper's model is configs/sasrec_yambda.yml in "
                     f"the repository)")
    rows = select(paper_rows(), args.rows)
    info = dict(device=jax.devices()[0].device_kind, jax=jax.__version__, libtpu=aot.libtpu_version() or "unknown",
                date=time.strftime("%Y-%m-%d"), steps=args.steps, window=args.window, rounds=args.rounds,
                config=Path(base).name, overrides=list(args.overrides))
    done = []
    for i, row in enumerate(rows, 1):
        print(f"[table3] {i}/{len(rows)} {row.key}", flush=True)
        done.append(measure(row, base, steps=args.steps, window=args.window, rounds=args.rounds,
                            extra=args.overrides, log=lambda *a: print(*a, flush=True)))
        merge(Path(args.json), info, done[-1:])
    print(f"[table3] wrote {args.json}: {len(done)} rows", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
