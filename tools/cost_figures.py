"""What exactness costs from V = 10^6 to 10^9 items: docs/sharding.md's cost table, against sampled_softmax.

Two commands, one on each machine:

    # on one TPU v5e chip: each row's per-chip work at its per-chip shape, timed (the `device` tool)
    python -m tools.cost_figures chip --out docs/figures/tpu/v5e-cost.json
    python -m tools.cost_figures probe --out docs/figures/tpu/v5e-cost-probe.json   # the target term, the draw
    # here (libtpu, no chip): each row's whole step compiled for v5e-256, and the table's record
    python -m tools.cost_figures record --chip docs/figures/tpu/v5e-cost.json --out docs/figures/cost/v5e-256.json

A row is `configs/sasrec_billion.yml` (the paper's SASRec, D = 256, N = 256, L = 8, global batch 1024,
the item table split over all 256 chips, bfloat16 with row-wise AdaGrad) at ``vocab_size=V``, with its
own exact loss (cutbce_pallas) or ``loss=sampled_softmax num_negatives=512``. Per chip, the loss sees
every one of the batch's M = B·N rows (the vocab axis all-gathers them) against its V/256 table rows.

The chip command times, in interleaved rounds beside the chip's matmul and HBM rates:

    loss        the strategy's loss and gradients (hidden, table, bias) at M × V/256, as the step calls it
    optimizer   the item tables' update (row-wise AdaGrad, stochastic rounding to bfloat16) of V/256 rows
    checkpoint  an Orbax save and restore of one chip's item state to the host's local disk (GB/s)

The record command compiles each row's step ahead of time (`recloss_plugins.sasrec.aot.compile_step`)
and takes from it the per-chip HBM (XLA's count and memory_analysis), the bytes its collectives move
per chip (`collective_bytes`, from the optimized HLO) and the state a chip holds (the checkpoint's
share). The step time it states is the sum of the chip's measured loss and optimizer times and the
collectives' bytes over the v5e's ICI (`ICI_BYTES_PER_S`): an estimate of the parts that grow with V,
not a measured step (the 3-layer transformer on 4 sequences a chip is left out).
"""

from __future__ import annotations

import argparse
import json
import math
import re
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Dict, List, Optional

from tools.cost_table import format_table

CONFIG = "configs/sasrec_billion.yml"
TOPOLOGY = "v5e-256"
VOCABS = (10**6, 10**7, 10**8, 10**9)
LOSSES = {"exact": (), "sampled K=512": ("loss=sampled_softmax", "num_negatives=512")}
# Cloud TPU v5e: 51.2 TB/s all-reduce bandwidth per 256-chip pod, 200 GB/s a chip (400 GB/s
# bidirectional ICI per chip); docs.cloud.google.com/tpu/docs/v5e.
ICI_BYTES_PER_S = 200e9
FORMAT = 1


def _log(msg: str):
    print(msg, file=sys.stderr, flush=True)


def config(vocab: int, loss: str, root: Optional[Path] = None):
    from recloss_plugins.config import load_config
    from tools import figures
    root = figures.ROOT if root is None else root
    return load_config([str(root / CONFIG), f"vocab_size={vocab}", *LOSSES[loss]])


def per_chip(cfg) -> dict:
    """The loss's per-chip shape of a row: M rows (all of the batch's), its V/256 table rows, D, L. The
    rows are padded as `recloss.padded_vocab_size` pads them on 256 table shards (`compile_row` checks
    it against the compiled program's)."""
    shards = 256
    rows = -(-cfg.vocab_size // (shards * 128)) * shards * 128
    return dict(M=cfg.global_batch_size * cfg.max_seq_len, V_chip=rows // shards, D=cfg.emb_dim, L=cfg.num_labels,
                B=cfg.global_batch_size, N=cfg.max_seq_len)


# ----------------------------------------------------------------------------- on the chip
def _inputs(cfg, shape: dict):
    """One chip's loss inputs at ``shape``, as the step makes them: hidden [B, N, D] in the compute dtype,
    the item table [V/256, D] and bias in the table dtype, targets [B, N, L]."""
    import jax
    import jax.numpy as jnp

    from recloss_plugins.sasrec import program as program_lib

    vc, d = shape["V_chip"], shape["D"]
    k1, k2, k3 = jax.random.split(jax.random.key(0), 3)
    tdt = jnp.dtype(cfg.item_table_dtype)
    h = jax.random.normal(k1, (shape["B"], shape["N"], d), jnp.float32).astype(program_lib.compute_dtype(cfg.dtype))
    e = (jax.random.normal(k2, (vc, d), jnp.float32) / d ** 0.5).astype(tdt)
    b = jnp.full((vc,), -8.0, tdt)
    t = jax.random.randint(k3, (shape["B"], shape["N"], shape["L"]), 1, vc, jnp.int32)
    return h, e, b, t


def _loss_fn(cfg, shape: dict):
    """The jitted loss and gradients (in hidden, table, bias) of one chip's loss call with the config's
    loss options (a sampled loss: the step's uniform proposal and a fixed key)."""
    import jax

    import recloss
    from recloss_plugins.config import loss_options
    from recloss_plugins.sasrec import program as program_lib

    vc = shape["V_chip"]
    strategy = recloss.get_strategy(cfg.loss, loss_options(cfg, vocab_size=vc))
    extra = {}
    if strategy.objective == "sampled":
        extra = dict(key=jax.random.key(1), log_q=program_lib.uniform_log_q(vc, vc))
    return jax.jit(jax.value_and_grad(lambda h, e, b, t: strategy(h, e, t, None, b, **extra).loss, argnums=(0, 1, 2)))


def _optimizer_fn(cfg, shape: dict):
    """A call of the run's optimizer on one chip's item embedding and bias (donated: each call updates them)."""
    import jax
    import jax.numpy as jnp

    from recloss_plugins.sasrec import optim, program as program_lib

    vc, d = shape["V_chip"], shape["D"]
    tdt = jnp.dtype(cfg.item_table_dtype)
    params = {"item_emb": {"embedding": jnp.zeros((vc, d), tdt)}, "out_bias": jnp.zeros((vc,), tdt)}
    grads = jax.tree.map(lambda p: jnp.full(p.shape, 1e-3, p.dtype), params)
    tx, _ = program_lib.make_optimizer(cfg)
    state = tx.init(params)

    def step(params, state, grads, key):
        updates, state = tx.update(grads, state, params)
        return optim.apply_updates(params, updates, key), state

    fn = jax.jit(step, donate_argnums=(0, 1))
    box = {"params": params, "state": state}

    def run():
        box["params"], box["state"] = fn(box["params"], box["state"], grads, jax.random.key(2))
        return box["params"]
    return run


def _checkpoint_rate(shape: dict, repeats: int = 3) -> dict:
    """Orbax save and restore of one chip's item state (bf16 table and bias, two float32 accumulators)
    to the host's local disk: medians in GB/s."""
    import jax
    import jax.numpy as jnp
    import orbax.checkpoint as ocp

    vc, d = shape["V_chip"], shape["D"]
    state = {"table": jnp.ones((vc, d), jnp.bfloat16), "bias": jnp.ones((vc,), jnp.bfloat16),
             "acc_table": jnp.ones((vc,), jnp.float32), "acc_bias": jnp.ones((vc,), jnp.float32)}
    nbytes = sum(x.nbytes for x in jax.tree.leaves(state))
    abstract = jax.tree.map(ocp.utils.to_shape_dtype_struct, state)
    save, restore = [], []
    for i in range(repeats):
        with tempfile.TemporaryDirectory(prefix="recloss-cost-") as tmp:
            ck = ocp.StandardCheckpointer()
            t0 = time.perf_counter()
            ck.save(Path(tmp) / "s", state)
            ck.wait_until_finished()
            save.append(time.perf_counter() - t0)
            t0 = time.perf_counter()
            jax.block_until_ready(ck.restore(Path(tmp) / "s", abstract))
            restore.append(time.perf_counter() - t0)
            ck.close()
    return dict(bytes=nbytes, save_gb_s=nbytes / statistics.median(save) / 1e9,
                restore_gb_s=nbytes / statistics.median(restore) / 1e9, save_s=save, restore_s=restore)


def _rounds(timers: dict, rounds: int, rng, rates, out: dict) -> Dict[str, List[float]]:
    """``rounds`` rounds of every timer in a new order each, then the chip's two rates."""
    import jax

    times: Dict[str, List[float]] = {k: [] for k in timers}
    for _ in range(rounds):
        order = list(timers)
        rng.shuffle(order)
        for name in order:
            t0 = time.perf_counter()
            jax.block_until_ready(timers[name]())
            times[name].append(time.perf_counter() - t0)
        out["roof_flop_s"].append(rates[0]())
        out["hbm_bytes_s"].append(rates[1]())
    return times


def measure_chip(rounds: int = 3, vocabs=VOCABS, *, require_tpu: bool = True) -> dict:
    """The chip record: per V, the losses' times (interleaved) and then the optimizer's, at the per-chip
    shape, in ``rounds`` rounds beside the chip's matmul and HBM rates; then the checkpoint rate at the
    largest per-chip state."""
    import gc
    import random

    import jax
    import jax.numpy as jnp

    from recloss.bench import chip

    if require_tpu and jax.default_backend() != "tpu":
        raise RuntimeError(f"the cost figures' chip part measures a TPU; JAX's backend here is {jax.default_backend()!r}")
    rates = chip._rates()
    out = {"format": FORMAT, "device": jax.devices()[0].device_kind, "jax": jax.__version__, "rounds": rounds,
           "rows": [], "roof_flop_s": [], "hbm_bytes_s": []}
    rng = random.Random(0)
    shape = None
    for vocab in vocabs:
        cfgs = {loss: config(vocab, loss) for loss in LOSSES}
        shape = per_chip(cfgs["exact"])
        h, e, b, t = _inputs(cfgs["exact"], shape)
        timers, finite = {}, {}
        for loss, cfg in cfgs.items():
            fn = _loss_fn(cfg, shape)
            t0 = time.perf_counter()
            value, grads = jax.block_until_ready(fn(h, e, b, t))
            finite[loss] = bool(jnp.isfinite(value)) and all(bool(jnp.all(jnp.isfinite(g))) for g in grads)
            _log(f"[cost] V={vocab:.0e} {loss}: first call {time.perf_counter() - t0:.1f}s, loss {float(value):.5g}, "
                 f"finite {finite[loss]}")
            del grads
            timers[loss] = lambda fn=fn: fn(h, e, b, t)
        times = _rounds(timers, rounds, rng, rates, out)
        del timers, h, e, b, t
        gc.collect()
        run_opt = _optimizer_fn(cfgs["exact"], shape)
        jax.block_until_ready(run_opt())
        finite["optimizer"] = True
        times.update(_rounds({"optimizer": run_opt}, rounds, rng, rates, out))
        del run_opt
        gc.collect()
        for name, ts in times.items():
            out["rows"].append(dict(V=vocab, part=name, shape=shape, finite=finite[name], seconds=ts,
                                    median_s=statistics.median(ts)))
            _log(f"[cost] V={vocab:.0e} {name}: median {statistics.median(ts) * 1e3:.2f} ms of {len(ts)}")
    out["checkpoint"] = dict(_checkpoint_rate(shape), shape=shape)
    _log(f"[cost] checkpoint: save {out['checkpoint']['save_gb_s']:.2f} GB/s, restore "
         f"{out['checkpoint']['restore_gb_s']:.2f} GB/s of {out['checkpoint']['bytes'] / 2**30:.2f} GiB")
    out["roof_flop_s_median"] = statistics.median(out["roof_flop_s"])
    out["hbm_bytes_s_median"] = statistics.median(out["hbm_bytes_s"])
    return out


def probe_chip(vocabs=(10**6, 10**8, 10**9), repeats: int = 5) -> dict:
    """What the loss spends besides its sweep, at the rows' per-chip shape: the targets' logits and their
    gradient (`recloss.targets.gather_logits`: M·L rows gathered, then scatter-added into dE; the
    sampled loss's whole target term) and the sampled draw of K = 512 ids (`recloss.sampled.sampler.draw`
    from the uniform proposal), medians of ``repeats`` calls."""
    import jax
    import jax.numpy as jnp

    from recloss import targets as targets_lib
    from recloss.sampled import sampler
    from recloss_plugins.sasrec import program as program_lib

    out = {"format": FORMAT, "device": jax.devices()[0].device_kind, "jax": jax.__version__, "rows": []}
    for vocab in vocabs:
        shape = per_chip(config(vocab, "exact"))
        m, d, vc, k = shape["M"], shape["D"], shape["V_chip"], 512
        keys = jax.random.split(jax.random.key(0), 3)
        h = jax.random.normal(keys[0], (m, d), jnp.float32)
        e = (jax.random.normal(keys[1], (vc, d), jnp.float32) / d ** 0.5).astype(jnp.bfloat16)
        b = jnp.zeros((vc,), jnp.bfloat16)
        ids = jax.random.randint(keys[2], (m, shape["L"]), 0, vc, jnp.int32)
        gather = jax.jit(jax.value_and_grad(lambda h, e, b: jnp.sum(targets_lib.gather_logits(h, e, b, ids)),
                                            argnums=(0, 1, 2)))
        draw = jax.jit(lambda lq, key: sampler.draw(key, sampler.local(lq), k, vocab_size=vc))
        lq = program_lib.uniform_log_q(vc, vc)
        for part, call in (("targets", lambda: gather(h, e, b)), ("draw", lambda: draw(lq, jax.random.key(3)))):
            jax.block_until_ready(call())
            ts = []
            for _ in range(repeats):
                t0 = time.perf_counter()
                jax.block_until_ready(call())
                ts.append(time.perf_counter() - t0)
            out["rows"].append(dict(V=vocab, part=part, shape=shape, seconds=ts, median_s=statistics.median(ts)))
            _log(f"[cost] V={vocab:.0e} {part}: median {statistics.median(ts) * 1e3:.2f} ms of {repeats}")
        del h, e, b, ids
    return out


# ----------------------------------------------------------------------------- the compiled step
_COLLECTIVE = re.compile(r"=\s*(?P<out>\S.*?)\s(?P<op>all-gather|all-reduce|reduce-scatter|collective-permute|"
                         r"all-to-all)(?P<start>-start)?\((?P<rest>.*)$")
_ARRAY = re.compile(r"\b(pred|s8|u8|s16|u16|bf16|f16|s32|u32|f32|s64|u64|f64)\[([0-9,]*)\]")
_BYTES = dict(pred=1, s8=1, u8=1, s16=2, u16=2, bf16=2, f16=2, s32=4, u32=4, f32=4, s64=8, u64=8, f64=8)
_COMPUTATION = re.compile(r"^(?:ENTRY\s+)?%(?P<name>[\w.\-]+)\s.*\{\s*$")
_CALLED = re.compile(r"(?:calls|to_apply|body|condition|true_computation|false_computation|"
                     r"branch_computations|called_computations)=\{?%?(?P<names>[\w.\-]+(?:,\s*%[\w.\-]+)*)")
_TRIPS = re.compile(r"\"known_trip_count\":\{\"n\":\"(\d+)\"")


def _arrays(text: str) -> List[int]:
    return [_BYTES[t] * math.prod(int(x) for x in dims.split(",") if x) for t, dims in _ARRAY.findall(text)]


def _group_size(rest: str, devices: int) -> int:
    m = re.search(r"replica_groups=mesh\[(?P<axes>[^\]]*)\]\s*\{(?P<used>[^}]*)\}", rest)
    if m:
        sizes = dict((k.strip("' "), int(v)) for k, v in (a.split("=") for a in m.group("axes").split(",")))
        return math.prod(sizes[a.strip("' ")] for a in m.group("used").split(",") if a.strip())
    m = re.search(r"replica_groups=\[(\d+),(\d+)\]", rest)
    if m:
        return int(m.group(2))
    m = re.search(r"replica_groups=\{\{([0-9,]*)\}", rest)
    if m:
        return len(m.group(1).split(","))
    return 2 if "source_target_pairs=" in rest else devices


def collective_bytes(hlo: str, devices: int) -> Dict[str, float]:
    """Bytes each chip receives over ICI per step, by collective kind, from an optimized HLO module.

    One logical collective per (kind, channel_id): XLA:TPU splits an async collective into pieces in
    several computations that share its channel. Per collective on a group of n chips with result
    bytes R: all-gather R·(n−1)/n, reduce-scatter R·(n−1), all-reduce 2·R·(n−1)/n (a ring:
    reduce-scatter, then all-gather), all-to-all R·(n−1)/n, collective-permute R. A collective
    reached through a while loop counts its known trip count times."""
    comps: Dict[str, List[str]] = {}
    entry, current = None, None
    for line in hlo.splitlines():
        m = _COMPUTATION.match(line)
        if m and " = " not in line.split("{")[0]:
            current = m.group("name")
            comps[current] = []
            if line.startswith("ENTRY"):
                entry = current
        elif current is not None:
            comps[current].append(line)
    times: Dict[str, int] = {}

    def visit(name: str, k: int, depth: int = 0):
        if name not in comps or depth > 64 or times.get(name, 0) >= k:
            return
        times[name] = k
        for line in comps[name]:
            trip = _TRIPS.search(line) if " while(" in line else None
            for m in _CALLED.finditer(line):
                for callee in m.group("names").split(","):
                    callee = callee.strip().lstrip("%")
                    looped = trip is not None and line[m.start():].startswith("body=")
                    visit(callee, k * (int(trip.group(1)) if looped else 1), depth + 1)

    visit(entry, 1)
    seen: Dict[tuple, float] = {}
    for name, lines in comps.items():
        for line in lines:
            m = _COLLECTIVE.search(line)
            if not m:
                continue
            channel = re.search(r"channel_id=(\d+)", m.group("rest"))
            key = (m.group("op"), channel.group(1) if channel else id(line))
            sizes = _arrays(m.group("out"))
            r = max(sizes) if m.group("start") else sum(sizes)
            n = _group_size(m.group("rest"), devices)
            if n <= 1 or key in seen:
                continue
            moved = {"all-gather": r * (n - 1) / n, "reduce-scatter": r * (n - 1), "all-reduce": 2 * r * (n - 1) / n,
                     "all-to-all": r * (n - 1) / n, "collective-permute": r}[m.group("op")]
            seen[key] = times.get(name, 1) * moved
    out: Dict[str, float] = {}
    for (op, _), b in seen.items():
        out[op] = out.get(op, 0.0) + b
    return out


def compile_row(vocab: int, loss: str) -> dict:
    """One row's step compiled for v5e-256: per-chip HBM, collectives' bytes, state bytes per chip."""
    import jax

    from recloss import aot
    from recloss_plugins.sasrec import aot as step_aot, parallel

    cfg = config(vocab, loss)
    devices = parallel.topology_devices(TOPOLOGY, 1)
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="recloss-cost-") as dump:
        compiled, rep, program = step_aot.compile_step(cfg, devices, vocab, dump_to=dump)
        xla = aot.hbm_bytes(dump)
    hlo = compiled.as_text()
    state_bytes = sum(x.dtype.itemsize * math.prod(sh.shard_shape(x.shape))
                      for x, sh in zip(jax.tree.leaves(program.abstract_state),
                                       jax.tree.leaves(program.state_shardings)))
    hosts = len({getattr(d, "process_index", 0) for d in devices})   # the topology's hosts (64 on v5e-256)
    shape = per_chip(cfg)
    if program.rows != shape["V_chip"] * 256:
        raise RuntimeError(f"per_chip gives {shape['V_chip']} table rows a chip, the compiled step "
                           f"{program.rows} / 256: the chip's times would be of another shape")
    return dict(V=vocab, loss=loss, strategy=cfg.loss, mesh=dict(program.mesh.shape), shape=shape,
                hbm_bytes=int(rep["total"]), xla_hbm_bytes=int(xla), collective_bytes=collective_bytes(hlo, len(devices)),
                state_bytes_per_chip=int(state_bytes), chips_per_host=len(devices) // hosts,
                compile_s=round(time.perf_counter() - t0, 1))


def record(chip_path: str, out_path: str, vocabs=VOCABS, probe_path: Optional[str] = None) -> dict:
    """The cost record: each row compiled here, with the chip record's times (and the probe's) beside it."""
    from recloss import aot
    from tools import figures

    chip_rec = json.loads(Path(chip_path).read_text())
    probe = json.loads(Path(probe_path).read_text()) if probe_path else None
    aot.libtpu_env()
    rows = []
    for vocab in vocabs:
        for loss in LOSSES:
            _log(f"[cost] compiling V={vocab:.0e} {loss} for {TOPOLOGY} ...")
            row = compile_row(vocab, loss)
            _log(f"[cost]   XLA's count {row['xla_hbm_bytes'] / 2**30:.3f} GiB, memory_analysis "
                 f"{row['hbm_bytes'] / 2**30:.3f} GiB; collectives {sum(row['collective_bytes'].values()) / 2**20:.1f} "
                 f"MiB a chip; compiled in {row['compile_s']}s")
            rows.append(row)
    payload = {"format": FORMAT, "topology": TOPOLOGY, "config": CONFIG, "stack": figures.current_stack(),
               "ici_bytes_per_s": ICI_BYTES_PER_S, "chip": chip_rec, "probe": probe, "rows": rows,
               "command": f"python -m tools.cost_figures record --chip {chip_path}"
                          + (f" --probe {probe_path}" if probe_path else "") + f" --out {out_path}"}
    Path(out_path).parent.mkdir(parents=True, exist_ok=True)
    Path(out_path).write_text(json.dumps(payload, indent=1) + "\n")
    return payload


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tools.cost_figures", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    c = sub.add_parser("chip", help="on a TPU v5e: time each row's per-chip work")
    c.add_argument("--out", required=True)
    c.add_argument("--rounds", type=int, default=3)
    c.add_argument("--vocabs", default=",".join(str(v) for v in VOCABS))
    pr = sub.add_parser("probe", help="on a TPU v5e: the target term and the sampled draw alone")
    pr.add_argument("--out", required=True)
    r = sub.add_parser("record", help="here: compile each row for v5e-256 and write the cost record")
    r.add_argument("--chip", required=True, help="the chip command's JSON")
    r.add_argument("--probe", help="the probe command's JSON (the target term and the draw alone)")
    r.add_argument("--out", required=True)
    r.add_argument("--vocabs", default=",".join(str(v) for v in VOCABS))
    s = sub.add_parser("show", help="print the table of a cost record")
    s.add_argument("record")
    args = parser.parse_args(argv)
    if args.command == "show":
        print(format_table(json.loads(Path(args.record).read_text())))
        return 0
    if args.command == "probe":
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(probe_chip(), indent=1) + "\n")
        return 0
    vocabs = tuple(int(float(v)) for v in args.vocabs.split(","))
    if args.command == "chip":
        payload = measure_chip(args.rounds, vocabs)
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(payload, indent=1) + "\n")
        _log(f"[cost] wrote {args.out}")
        return 0
    payload = record(args.chip, args.out, vocabs, args.probe)
    print(format_table(payload))
    return 0


if __name__ == "__main__":
    sys.exit(main())
