"""The quality-vs-cost table: `recloss-train` on one data set, varying only the loss.

    python -m tools.quality [config.yml] [key=value ...] [--hbm] [--out table.md] [--json run.json]
    make quality                       # the embedded synthetic data (configs/base.yml)
    make quality DATA=path/to/log.csv  # any interactions file (dataset_type=interactions)

Every row trains the same model from the same seed for the same steps; only ``loss`` (and its
``num_negatives``) differ. Columns: dev/test Hit@10 and NDCG@10 (``eval_top_k=10``), train
steps/s of the compiled step on this machine, its compiled per-device temporaries, and with
``--hbm`` the per-chip HBM of the paper's SASRec step (configs/sasrec_yambda.yml) compiled for
v6e-8 (one `recloss-train ... compile_topology=v6e-8` subprocess per row).
One seed, one data set: differences smaller than seed noise are not findings.
"""

from __future__ import annotations

import itertools
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path
from typing import Dict, List, Optional, Tuple

import jax
import numpy as np

import recloss

from recloss_plugins.config import load_config
from recloss_plugins.config.keys import SCHEMA
from recloss_plugins.config.loss_keys import LOSS_OPTION_KEYS
from recloss.aot import memory_report
from recloss_plugins.sasrec import data as data_lib
from recloss_plugins.sasrec.train import train
from tools.figures import ROOT, config_parser

# (row label, config overrides): the losses the table compares.
ROWS: List[Tuple[str, Tuple[str, ...]]] = [
    ("cutbce", ("loss=cutbce",)),
    ("cutce", ("loss=cutce",)),
    # The shipped defaults of the sampled losses (configs/base.yml: sampled_proposal auto, i.e. uniform
    # negatives for both; accidental hits removed).
    ("sampled_softmax K=128", ("loss=sampled_softmax", "num_negatives=128")),
    ("sampled_softmax K=1024", ("loss=sampled_softmax", "num_negatives=1024")),
    # ... and negatives from the training counts with the logQ correction instead.
    ("sampled_softmax K=128, counts (logQ)", ("loss=sampled_softmax", "num_negatives=128",
                                              "sampled_proposal=counts")),
    ("gbce K=128", ("loss=gbce", "num_negatives=128")),
    # gbce applies no logQ correction: counts only move its negatives toward popular items.
    ("gbce K=128, negatives from counts (no correction)", ("loss=gbce", "num_negatives=128",
                                                           "sampled_proposal=counts")),
    ("dense_bce", ("loss=dense_bce",)),
]
# The table's defaults on top of the user's config: modest steps so it runs in minutes on a CPU.
DEFAULTS = ("steps=300", "eval_top_k=10", "enable_checkpointing=false", "enable_tensorboard=false",
            "log_period=100")
YAMBDA = ROOT / "configs" / "sasrec_yambda.yml"
# The v6e-8 rows use the paper's loss kernels where one exists (as configs/sasrec_yambda.yml does).
HBM_LOSS = {"cutbce": "cutbce_pallas", "cutce": "cutce_pallas"}
NOT_RUN = "not run (--hbm)"


def steps_per_second(result, ds, repeats: int = 10) -> float:
    """Steps/s of the run's compiled train step on one real batch, after one warm-up step."""
    program = result.program
    compiled = program.compiled_train_step()
    batch = data_lib.TrainBatches(ds.train, program.batch_size, program.cfg.seed).batch(0)
    batch = {k: jax.device_put(v, program.batch_shardings[k]) for k, v in batch.items()}
    state = jax.tree.map(lambda x: x.copy(), result.state)
    inputs = program.step_inputs(ds.popularity)
    state, m = compiled(state, batch, inputs)
    jax.block_until_ready(m)
    t0 = time.perf_counter()
    for _ in range(repeats):
        state, m = compiled(state, batch, inputs)
    jax.block_until_ready((state, m))
    return repeats / (time.perf_counter() - t0)


def v6e8_hbm(loss_args: Tuple[str, ...], timeout_s: float) -> str:
    """Per-chip HBM (GiB) of configs/sasrec_yambda.yml's train step compiled for v6e-8, as text."""
    args = [a if not a.startswith("loss=") else "loss=" + HBM_LOSS.get(a[5:], a[5:]) for a in loss_args]
    cmd = [sys.executable, "-m", "recloss_plugins.sasrec.train", str(YAMBDA), "compile_topology=v6e-8", *args]
    try:
        run = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s)
    except subprocess.TimeoutExpired:
        return f"compile > {timeout_s:.0f}s"
    text = run.stdout + run.stderr
    m = re.search(r"per-chip HBM: total ([0-9.]+) GiB", text)
    if m:
        return f"{float(m.group(1)):.2f}"
    oom = re.search(r"Used [0-9.]+[KMGT]i?B? of [0-9.]+[KMGT]i?B? hbm", text)
    return f"OOM ({oom.group(0)})" if oom else f"failed (rc {run.returncode})"


def _sweep_overrides(sweep: Dict[str, List[str]], args: Tuple[str, ...]) -> List[Tuple[str, ...]]:
    """Every combination of ``sweep``'s values a row's loss takes (a key its strategy does not take,
    e.g. temperature for a BCE loss, is left out for that row); [()] without a sweep."""
    loss = next(a[5:] for a in args if a.startswith("loss="))
    takes = set(recloss.get_strategy(loss).options_supported)
    keys = [k for k in (sweep or {}) if k not in LOSS_OPTION_KEYS or LOSS_OPTION_KEYS[k].field in takes]
    return [tuple(f"{k}={v}" for k, v in zip(keys, vals)) for vals in itertools.product(*(sweep[k] for k in keys))]


def run_table(config: List[str], *, hbm: bool, hbm_timeout_s: float = 900.0,
              sweep: Optional[Dict[str, List[str]]] = None, log=print) -> List[Dict]:
    """One training run per row of `ROWS` on ``config`` (a YAML path and key=value overrides); with
    ``sweep`` ({key: [values]}), one per combination of values, the row reporting the one best on
    dev NDCG (its overrides under 'chosen', every run's dev NDCG under 'sweep')."""
    rows = []
    ds = None
    for label, args in ROWS:
        tag = re.sub(r"[^a-z0-9]+", "_", label.lower())
        best, tried = None, []
        for extra in _sweep_overrides(sweep, args):
            cfg = load_config([*config[:1], *DEFAULTS, *config[1:], *args, *extra, f"run_name=quality_{tag}"])
            if ds is None:
                ds = data_lib.build_dataset(cfg)
            t0 = time.perf_counter()
            res = train(cfg, dataset=ds, log=lambda *a: None)
            wall = time.perf_counter() - t0
            dev = res.evals["dev"][f"ndcg@{cfg.eval_top_k}"]
            tried.append({"overrides": list(extra), "dev_ndcg": dev})
            if len(tried) > 1:
                log(f"{label} {' '.join(extra)}: dev NDCG@{cfg.eval_top_k} {dev:.4f}")
            if best is None or dev > best[0]:
                best = (dev, extra, res, cfg, wall)
        _, extra, res, cfg, wall = best
        row = {"loss": label, "wall_s": wall, "steps": cfg.steps}
        k = cfg.eval_top_k
        for split in ("dev", "test"):
            row[f"{split}_hit"] = res.evals[split][f"hit@{k}"]
            row[f"{split}_ndcg"] = res.evals[split][f"ndcg@{k}"]
        row["steps_per_s"] = steps_per_second(res, ds)
        row["temp_mib"] = memory_report(res.program.compiled_train_step()).get("temp", float("nan")) / 2**20
        row["v6e8_gib"] = v6e8_hbm((*args, *extra), hbm_timeout_s) if hbm else NOT_RUN
        if sweep:
            row.update(chosen=list(extra), sweep=tried)
        log(f"{label}: " + ", ".join(f"{k} {v:.4g}" if isinstance(v, float) else f"{k} {v}"
                                    for k, v in row.items() if k not in ("loss", "sweep")))
        rows.append(row)
    return rows


def markdown(rows: List[Dict], k: int = 10) -> str:
    """The table; the v6e-8 column only when a row compiled for it (``--hbm``), the swept values
    only when the run swept (``--sweep``)."""
    hbm = any(r["v6e8_gib"] != NOT_RUN for r in rows)
    swept = any("chosen" in r for r in rows)
    head = (f"| loss | dev Hit@{k} | dev NDCG@{k} | test Hit@{k} | test NDCG@{k} | train steps/s | "
            "per-device temp (MiB) |" + (" v6e-8 per-chip HBM, SASRec-Yambda (GiB) |" if hbm else "")
            + (" best on dev |" if swept else ""))
    lines = [head, "|" + "---|" * head.count(" |")] + [
        f"| {r['loss']} | {r['dev_hit']:.4f} | {r['dev_ndcg']:.4f} | {r['test_hit']:.4f} | {r['test_ndcg']:.4f} "
        f"| {r['steps_per_s']:.1f} | {r['temp_mib']:.1f} |" + (f" {r['v6e8_gib']} |" if hbm else "")
        + (f" {' '.join(r.get('chosen', [])) or '–'} |" if swept else "") for r in rows]
    return "\n".join(lines)


def format_run(data: Dict) -> str:
    """A ``--json`` file as the table and a line saying what ran (docs/choosing-a-loss.md renders it)."""
    info, rows = data["info"], data["rows"]
    runs = sum(len(r.get("sweep", [None])) for r in rows)
    swept = "".join(f" --sweep {k}={','.join(v)}" for k, v in info.get("sweep", {}).items())
    best = (f"; each row is its run best on dev NDCG@{info['eval_top_k']} of the sweep{swept}" if swept else "")
    return (markdown(rows, info["eval_top_k"]) + "\n\n"
            f"{runs} runs of {info['steps']} steps in {info['total_s']:.0f} s on "
            f"{info['cpu_count']} CPU cores (jax {info['jax_version']}): {' '.join(info['config'])}{best}")


def main(argv: Optional[List[str]] = None) -> int:
    p = config_parser(__doc__)
    p.add_argument("--hbm", action="store_true", help="also compile each row for v6e-8 (SASRec-Yambda)")
    p.add_argument("--hbm-timeout", type=float, default=900.0, help="seconds per v6e-8 compile")
    p.add_argument("--out", help="write the markdown table here too")
    p.add_argument("--json", help="write the rows and what ran as JSON here (the docs render it)")
    p.add_argument("--sweep", action="append", default=[], metavar="KEY=V1,V2,...",
                   help="train each row once per value (repeatable: every combination) and report the run best "
                        "on dev NDCG, e.g. --sweep learning_rate=1e-3,3e-3,1e-2 --sweep temperature=0.5,1.0 "
                        "(a key a row's loss does not take is left out for that row)")
    a = p.parse_args(argv)
    sweep = {}
    for item in a.sweep:
        key, eq, values = item.partition("=")
        if not eq or not key or not values.strip(","):
            p.error(f"--sweep {item!r}: expected KEY=V1,V2,... (e.g. learning_rate=1e-3,3e-3)")
        if key not in SCHEMA:
            p.error(f"--sweep {item!r}: {key!r} is not a config key")
        sweep[key] = [v for v in values.split(",") if v]
    config = list(a.config)
    if not config or "=" in config[0]:
        config = [str(ROOT / "configs" / "base.yml")] + config
    t0 = time.perf_counter()
    rows = run_table(config, hbm=a.hbm, hbm_timeout_s=a.hbm_timeout, sweep=sweep or None,
                     log=lambda *x: print(*x, flush=True))
    first = load_config([*config[:1], *DEFAULTS, *config[1:]])
    info = dict(config=[_shown(config[0]), *DEFAULTS, *config[1:]], steps=first.steps,
                eval_top_k=first.eval_top_k, total_s=round(time.perf_counter() - t0),
                cpu_count=os.cpu_count(), jax_version=jax.__version__, **({"sweep": sweep} if sweep else {}))
    table = markdown(rows, first.eval_top_k)
    print(table)
    print(f"quality table: {sum(len(r.get('sweep', [None])) for r in rows)} runs in {info['total_s']}s")
    if a.out:
        Path(a.out).write_text(table + "\n")
    if a.json:
        Path(a.json).write_text(json.dumps(dict(info=info, rows=rows), indent=1) + "\n")
        print(f"wrote {a.json}", file=sys.stderr)
    return 0


def _shown(path: str) -> str:
    """``path`` relative to the repository when it lies inside it (a results file names no home dir)."""
    try:
        return str(Path(os.path.abspath(path)).relative_to(ROOT))     # not resolved: configs/base.yml is a link
    except ValueError:
        return path


if __name__ == "__main__":
    sys.exit(main())
