"""Input-pipeline benchmark: a generated interaction log -> recloss-prepare-data -> 2 training processes.

    python -m tools.input_bench --events 20000000 --dir /tmp/recloss_input_bench \
        [--memory] [--json summary.json]
    python -m tools.input_bench --mode prepare --events 20000000 [--json prep.json]

Writes a synthetic Parquet log of ``--events`` events (power-law users and items, in row groups,
never whole in memory) under ``--dir``, prepares it in a child process (wall time, peak RSS),
reads the train stream of each of 2 processes alone (sequences/s of the Grain pipeline, no model),
and trains the default model (configs/base.yml) for ``--steps`` steps as 2 processes × 4 CPU
devices through launch/local.py (steps/s after the first logging window, which holds the compile;
peak RSS of each process); ``--memory`` trains again with ``data_pipeline=memory`` (every process
loads the whole log) for its RSS. Prints the summary as a table (`format_summary`), and ``--json``
writes it for docs/data.md to render. Not a test: it takes minutes and a few GiB of disk.

``--mode prepare`` times only recloss-prepare-data, on the log as written (integer user ids) and on
the same events with string user ids (``user-<id>``), alternating ``--repeats`` times, and prints
both rates and their ratio (`format_prepare`).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import resource
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

from recloss_plugins.config import load_config
from tools.figures import ROOT

REPO = ROOT
# A logging window's rate in the trainer's log line ("... | 0.17 steps/s | ...").
RATE = re.compile(r"\| ([0-9.]+) steps/s \|")


def write_log(path: Path, events: int, users: int, items: int, seed: int = 0, chunk: int = 2_000_000,
              string_ids: bool = False):
    """A Parquet log (uid, item_id, timestamp) of ``events`` rows written ``chunk`` rows at a time;
    ``string_ids``: the same events with uid ``"user-<id>"`` (a string column)."""
    import pyarrow as pa
    import pyarrow.compute as pc
    import pyarrow.parquet as pq

    rng = np.random.default_rng(seed)
    schema = pa.schema([("uid", pa.string() if string_ids else pa.int64()), ("item_id", pa.int64()),
                        ("timestamp", pa.int64())])
    with pq.ParquetWriter(path, schema) as w:
        for lo in range(0, events, chunk):
            n = min(chunk, events - lo)
            u = (rng.pareto(1.2, n) * users / 8).astype(np.int64) % users
            i = (rng.pareto(1.0, n) * items / 16).astype(np.int64) % items
            uid = pa.array(u * 31 + 7)
            if string_ids:
                uid = pc.binary_join_element_wise("user-", uid.cast(pa.string()), "")
            w.write_table(pa.table({"uid": uid, "item_id": i * 17 + 3,
                                    "timestamp": lo + np.arange(n, dtype=np.int64)}, schema=schema),
                          row_group_size=500_000)


def _peak_rss_mib() -> float:
    """This process's peak resident set (VmHWM; ru_maxrss would carry the parent's peak over exec)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024.0
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0


def _read_mode(args):
    """Child: iterate one process's train stream; print sequences/s and peak RSS."""
    from recloss_plugins.sasrec.data.pipeline import GrainData

    d = GrainData(args.prepared, max_seq_len=args.max_seq_len, num_labels=args.num_labels,
                  process_index=args.process_index, process_count=2)
    it = d.train_iterator(args.batch, seed=0, read_threads=args.threads, prefetch=8)
    next(it)
    t0, n = time.perf_counter(), 0
    while time.perf_counter() - t0 < args.seconds:
        n += next(it)["inputs"].shape[0]
    dt = time.perf_counter() - t0
    print(json.dumps({"process": args.process_index, "sequences_per_s": n / dt, "peak_rss_mib": _peak_rss_mib()}))


def _train_mode(args, rest):
    """Child (one of 2 launch/local.py processes): train ``args.steps`` steps, no final eval."""
    import jax

    from recloss_plugins.sasrec import distributed, train

    distributed.initialize_from_env()
    lines = []
    res = train.train(load_config(rest), stop_after=args.steps, log=lambda *a: lines.append(" ".join(map(str, a))))
    # Each logging window's rate; the first holds the compile.
    rates = [float(m.group(1)) for line in lines for m in [RATE.search(line)] if m]
    print(json.dumps({"process": jax.process_index(), "peak_rss_mib": _peak_rss_mib(), "steps": res.steps_done,
                      "steps_per_s": rates[1:] or rates, "log": lines[-3:]}), flush=True)


def main(argv=None):
    p = argparse.ArgumentParser()
    p.add_argument("--events", type=int, default=20_000_000)
    p.add_argument("--users", type=int, default=200_000)
    p.add_argument("--items", type=int, default=100_000)
    p.add_argument("--dir", default="/tmp/recloss_input_bench")
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--seconds", type=float, default=20.0)
    p.add_argument("--threads", type=int, default=4)
    p.add_argument("--mode", default="all", choices=("all", "prepare", "read", "train"))
    p.add_argument("--repeats", type=int, default=3, help="--mode prepare: preparations of each log")
    p.add_argument("--prepared", default="")
    p.add_argument("--process-index", type=int, default=0)
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--max-seq-len", type=int, default=32)
    p.add_argument("--num-labels", type=int, default=8)
    p.add_argument("--memory", action="store_true", help="also train with data_pipeline=memory (its RSS)")
    p.add_argument("--json", default=None, help="also write the summary as JSON to this path")
    args, rest = p.parse_known_args(argv)
    if args.steps < 3:
        p.error(f"--steps must be >= 3 (three logging windows; the first holds the compile), got {args.steps}")
    if args.mode == "read":
        return _read_mode(args)
    if args.mode == "train":
        return _train_mode(args, rest)
    if args.mode == "prepare":
        return _prepare_mode(args)

    root = Path(args.dir)
    root.mkdir(parents=True, exist_ok=True)
    log = root / "log.parquet"
    out = {"events": args.events}
    if not log.exists():
        t0 = time.perf_counter()
        write_log(log, args.events, args.users, args.items)
        out["generate_s"] = time.perf_counter() - t0
    out["log_mib"] = log.stat().st_size / 2**20
    prepared = root / "prepared"
    cfg = _prepare_cfg(log, prepared)
    env = dict(os.environ, JAX_PLATFORMS="cpu", TPU_SKIP_MDS_QUERY="1")
    run = _prepare(cfg, env)
    out.update(prepare_s=run["wall_s"], prepare_peak_rss_mib=run["peak_rss_mib"], prepare_summary=run["summary"])
    me = [sys.executable, "-m", "tools.input_bench"]
    out["read"] = []
    for pi in range(2):
        r = subprocess.run(me + ["--mode", "read", "--prepared", str(prepared), "--process-index", str(pi),
                                 "--seconds", str(args.seconds), "--threads", str(args.threads)],
                           capture_output=True, text=True, env=env, cwd=REPO)
        if r.returncode:
            raise SystemExit(r.stdout + r.stderr)
        out["read"].append(json.loads(r.stdout.strip().splitlines()[-1]))
    out.update(steps=args.steps, train_batch=load_config(cfg).global_batch_size, read_threads=args.threads)
    out["train"] = _train(me, args, cfg, root, env, "grain")
    if args.memory:
        out["train_memory"] = _train(me, args, cfg, root, env, "memory")
    print(format_summary(out))
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=1) + "\n")
        print(f"wrote {args.json}", file=sys.stderr)


def _prepare_cfg(log: Path, prepared: Path):
    return [str(REPO / "configs" / "base.yml"), "dataset_type=interactions", f"dataset_path={log}",
            f"prepared_data_path={prepared}", "min_user_interactions=31", "prepare_num_shards=16"]


def _prepare(cfg, env) -> dict:
    """recloss-prepare-data ``cfg`` in a child process: its wall time (start-up included), the
    preparation's own seconds, its peak RSS and its summary line."""
    t0 = time.perf_counter()
    r = subprocess.run([sys.executable, "-c", "import sys, json; "
                        "from recloss_plugins.sasrec.data.prepare import main; "
                        "from tools.input_bench import _peak_rss_mib; rc = main(sys.argv[1:]); "
                        "print(json.dumps({'peak_rss_mib': _peak_rss_mib()})); sys.exit(rc)", *cfg],
                       capture_output=True, text=True, env=env, cwd=REPO)
    if r.returncode:
        raise SystemExit(r.stdout + r.stderr)
    wall = time.perf_counter() - t0
    summary = [line for line in r.stdout.splitlines() if line.startswith("prepared ")][-1]
    return {"wall_s": wall, "seconds": float(re.search(r", ([0-9.]+)s$", summary).group(1)),
            "peak_rss_mib": json.loads(r.stdout.strip().splitlines()[-1])["peak_rss_mib"], "summary": summary}


def _prepare_mode(args):
    """Prepare the integer-id and the string-id log alternately, ``--repeats`` times each."""
    root = Path(args.dir)
    root.mkdir(parents=True, exist_ok=True)
    env = dict(os.environ, JAX_PLATFORMS="cpu", TPU_SKIP_MDS_QUERY="1")
    logs = {"int": root / "log.parquet", "string": root / "log-string-ids.parquet"}
    out = {"events": args.events, "repeats": args.repeats, "runs": {"int": [], "string": []}, "log_mib": {}}
    for kind, log in logs.items():
        if not log.exists():
            print(f"writing {log} ({args.events:,} events, {kind} user ids) ...", file=sys.stderr, flush=True)
            write_log(log, args.events, args.users, args.items, string_ids=kind == "string")
        out["log_mib"][kind] = log.stat().st_size / 2**20
    for rep in range(args.repeats):
        for kind, log in logs.items():
            run = _prepare(_prepare_cfg(log, root / f"prepared-{kind}"), env)
            out["runs"][kind].append(run)
            print(f"[{rep + 1}/{args.repeats}] {kind} user ids: {run['seconds']:.1f} s "
                  f"({run['wall_s']:.1f} s wall)", file=sys.stderr, flush=True)
    print(format_prepare(out))
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=1) + "\n")
        print(f"wrote {args.json}", file=sys.stderr)


def format_prepare(out: dict) -> str:
    """The integer- vs string-id preparation as a Markdown table: the median of each kind's own
    seconds (the summary line's, start-up excluded), the events/s they give, and the ratio of each
    interleaved pair."""
    med = {k: float(np.median([r["seconds"] for r in runs])) for k, runs in out["runs"].items()}
    pairs = [s["seconds"] / i["seconds"] for i, s in zip(out["runs"]["int"], out["runs"]["string"])]
    lines = [f"| user ids | log | preparation (median of {out['repeats']}) | events/s | peak RSS |",
             "|---|---|---|---|---|"]
    for kind in ("int", "string"):
        runs = out["runs"][kind]
        lines.append(f"| {'integers' if kind == 'int' else 'strings (`user-<id>`)'} | "
                     f"{out['log_mib'][kind]:.0f} MiB Parquet | {med[kind]:.1f} s | "
                     f"{out['events'] / med[kind] / 1e6:.2f} M | "
                     f"{max(r['peak_rss_mib'] for r in runs):,.0f} MiB |")
    lines += ["", f"String ids take {med['string'] / med['int']:.2f}x the integer-id time (interleaved pairs: "
                  f"{', '.join(f'{x:.2f}x' for x in pairs)}); both preparations "
                  f"{'kept the same' if len(_counts(out)) == 1 else 'DIFFER:'} {'; '.join(sorted(_counts(out)))}."]
    return "\n".join(lines)


_COUNTS = re.compile(r"[\d,]+ users, [\d,]+ items, [\d,]+ interactions \(of [\d,]+ events read\)")


def _counts(out: dict) -> set:
    """The users, items and interactions every preparation of ``out`` kept (one entry when they agree)."""
    return {_COUNTS.search(r["summary"]).group(0) for k in ("int", "string") for r in out["runs"][k]}


def _train(me, args, cfg, root: Path, env, pipeline: str):
    """[per-process summary] of ``args.steps`` steps as 2 processes x 4 CPU devices."""
    print(f"training {args.steps} steps, 2 processes x 4 devices, data_pipeline={pipeline} ...",
          file=sys.stderr, flush=True)
    r = subprocess.run([sys.executable, str(REPO / "launch" / "local.py"), "-n", "2", "-d", "4", "--exec", "--",
                        *me, "--mode", "train", "--steps", str(args.steps), *cfg, f"data_pipeline={pipeline}",
                        f"run_name=bench-{pipeline}", f"base_output_directory={root / 'runs'}",
                        "enable_checkpointing=false", "enable_tensorboard=false",
                        f"log_period={max(args.steps // 3, 1)}"],
                       capture_output=True, text=True, env=env, cwd=REPO)
    if r.returncode:
        raise SystemExit(r.stdout[-4000:] + r.stderr[-4000:])
    found = sorted((json.loads(line.split("] ", 1)[1]) for line in r.stdout.splitlines()
                   if "] {" in line and '"peak_rss_mib"' in line), key=lambda d: d["process"])
    if len(found) != 2 or not found[0]["steps_per_s"]:      # process 0 logs; both report their RSS
        raise SystemExit(f"expected a summary from each of 2 processes, with steps/s from process 0; got "
                         f"{found}:\n{r.stdout[-4000:]}")
    return found


def format_summary(out: dict) -> str:
    """The summary as a two-column Markdown table (docs/data.md renders it from the --json file)."""
    def each(rows, key, fmt="{:,.0f}"):
        return " and ".join(fmt.format(r[key]) for r in rows)

    rates = [x for r in out["train"] for x in r["steps_per_s"]]
    per_seq = out["train_batch"] / 2          # each process feeds half the global batch
    slowest_read = min(r["sequences_per_s"] for r in out["read"])
    fed = max(rates) * per_seq
    lines = [
        "| | |", "|---|---|",
        f"| log | {out['events']:,} events (Parquet, {out['log_mib']:.0f} MiB; power-law users and items) |",
        f"| prepared | {out['prepare_summary'].split(': ', 1)[-1]} |",
        f"| preparation | {out['prepare_s']:.1f} s wall (a child process, start-up included), "
        f"peak RSS {out['prepare_peak_rss_mib']:,.0f} MiB |",
        f"| Grain input alone, per process (of 2; {out['read_threads']} read threads) | "
        f"{each(out['read'], 'sequences_per_s')} sequences/s |",
        f"| training, 2 processes × 4 CPU devices, configs/base.yml (global batch {out['train_batch']}), "
        f"{out['steps']} steps | {min(rates):.2f}–{max(rates):.2f} steps/s after the compile: "
        f"~{fed:.1f} sequences/s per process |",
        f"| peak RSS per training process (`data_pipeline=grain`) | {each(out['train'], 'peak_rss_mib')} MiB |",
    ]
    if out.get("train_memory"):
        lines.append(f"| the same with `data_pipeline=memory` (every process loads the whole log) | "
                     f"{each(out['train_memory'], 'peak_rss_mib')} MiB |")
    lines += ["", f"Input outpaces training by a factor of ~{slowest_read / fed:,.0f} per process here "
                  f"({slowest_read:,.0f} vs {fed:.1f} sequences/s)."]
    return "\n".join(lines)


if __name__ == "__main__":
    main()
