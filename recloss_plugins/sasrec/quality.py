"""The quality-vs-cost table: `recloss-train` on one data set, varying only the loss.

    python -m recloss_plugins.sasrec.quality [config.yml] [key=value ...] [--hbm] [--out table.md] [--json run.json]
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

import argparse
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

from recloss_plugins.config import default_config_path, load_config
from recloss_plugins.sasrec import data as data_lib
from recloss.bench.buffers import memory_report
from recloss_plugins.sasrec.train import train

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
YAMBDA = Path(__file__).resolve().parents[2] / "configs" / "sasrec_yambda.yml"
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
    state, m = compiled(state, batch)
    jax.block_until_ready(m)
    t0 = time.perf_counter()
    for _ in range(repeats):
        state, m = compiled(state, batch)
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


def run_table(config: List[str], *, hbm: bool, hbm_timeout_s: float = 900.0, log=print) -> List[Dict]:
    """One training run per row of `ROWS` on ``config`` (a YAML path and key=value overrides)."""
    rows = []
    ds = None
    for label, args in ROWS:
        tag = re.sub(r"[^a-z0-9]+", "_", label.lower())
        cfg = load_config([*config[:1], *DEFAULTS, *config[1:], *args, f"run_name=quality_{tag}"])
        if ds is None:
            ds = data_lib.build_dataset(cfg)
        t0 = time.perf_counter()
        res = train(cfg, dataset=ds, log=lambda *a: None)
        wall = time.perf_counter() - t0
        row = {"loss": label, "wall_s": wall, "steps": cfg.steps}
        k = cfg.eval_top_k
        for split in ("dev", "test"):
            row[f"{split}_hit"] = res.evals[split][f"hit@{k}"]
            row[f"{split}_ndcg"] = res.evals[split][f"ndcg@{k}"]
        row["steps_per_s"] = steps_per_second(res, ds)
        row["temp_mib"] = memory_report(res.program.compiled_train_step()).get("temp", float("nan")) / 2**20
        row["v6e8_gib"] = v6e8_hbm(args, hbm_timeout_s) if hbm else NOT_RUN
        log(f"{label}: " + ", ".join(f"{k} {v:.4g}" if isinstance(v, float) else f"{k} {v}"
                                    for k, v in row.items() if k != "loss"))
        rows.append(row)
    return rows


def markdown(rows: List[Dict], k: int = 10) -> str:
    """The table; the v6e-8 column only when a row compiled for it (``--hbm``)."""
    hbm = any(r["v6e8_gib"] != NOT_RUN for r in rows)
    head = (f"| loss | dev Hit@{k} | dev NDCG@{k} | test Hit@{k} | test NDCG@{k} | train steps/s | "
            "per-device temp (MiB) |" + (" v6e-8 per-chip HBM, SASRec-Yambda (GiB) |" if hbm else ""))
    lines = [head, "|" + "---|" * head.count(" |")] + [
        f"| {r['loss']} | {r['dev_hit']:.4f} | {r['dev_ndcg']:.4f} | {r['test_hit']:.4f} | {r['test_ndcg']:.4f} "
        f"| {r['steps_per_s']:.1f} | {r['temp_mib']:.1f} |" + (f" {r['v6e8_gib']} |" if hbm else "") for r in rows]
    return "\n".join(lines)


def format_run(data: Dict) -> str:
    """A ``--json`` file as the table and a line saying what ran (docs/choosing-a-loss.md renders it)."""
    info = data["info"]
    return (markdown(data["rows"], info["eval_top_k"]) + "\n\n"
            f"{len(data['rows'])} runs of {info['steps']} steps in {info['total_s']:.0f} s on "
            f"{info['cpu_count']} CPU cores (jax {info['jax_version']}): {' '.join(info['config'])}")


def main(argv: Optional[List[str]] = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("config", nargs="*", help="a YAML config (default configs/base.yml) and key=value overrides")
    p.add_argument("--hbm", action="store_true", help="also compile each row for v6e-8 (SASRec-Yambda)")
    p.add_argument("--hbm-timeout", type=float, default=900.0, help="seconds per v6e-8 compile")
    p.add_argument("--out", help="write the markdown table here too")
    p.add_argument("--json", help="write the rows and what ran as JSON here (the docs render it)")
    a = p.parse_args(argv)
    config = list(a.config)
    if not config or "=" in config[0]:
        config = [str(default_config_path())] + config
    t0 = time.perf_counter()
    rows = run_table(config, hbm=a.hbm, hbm_timeout_s=a.hbm_timeout, log=lambda *x: print(*x, flush=True))
    first = load_config([*config[:1], *DEFAULTS, *config[1:]])
    info = dict(config=[_shown(config[0]), *DEFAULTS, *config[1:]], steps=first.steps,
                eval_top_k=first.eval_top_k, total_s=round(time.perf_counter() - t0),
                cpu_count=os.cpu_count(), jax_version=jax.__version__)
    table = markdown(rows, first.eval_top_k)
    print(table)
    print(f"quality table: {len(rows)} runs in {info['total_s']}s")
    if a.out:
        Path(a.out).write_text(table + "\n")
    if a.json:
        Path(a.json).write_text(json.dumps(dict(info=info, rows=rows), indent=1) + "\n")
        print(f"wrote {a.json}", file=sys.stderr)
    return 0


def _shown(path: str) -> str:
    """``path`` relative to the repository when it lies inside it (a results file names no home dir)."""
    try:
        return str(Path(path).resolve().relative_to(YAMBDA.parents[1]))
    except ValueError:
        return path


if __name__ == "__main__":
    sys.exit(main())
