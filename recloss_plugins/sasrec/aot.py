"""Ahead-of-time compilation of the train step for a TPU topology (like MaxText's train_compile).

    recloss-train configs/sasrec_yambda.yml compile_topology=v6e-8 loss=cutbce_pallas

Builds the mesh on the topology's devices (libtpu describes them; no TPU
needed), lowers and compiles the full train step (forward, loss, backward,
optimizer update) with the run's shardings, and prints the per-chip memory of the
compiled program (memory_analysis, and XLA's own count: what the chip enforces)
and its five largest buffers with the HLO op that owns each (`recloss.aot`), so
an OOM says what to change; then the same for the evaluation program (one batch
of eval_batch_size users ranked against the whole catalogue). With
``compile_fit_hbm_gib`` > 0 it also finds the largest global batch (a multiple
of the batch shards) whose step fits that budget.
"""

from __future__ import annotations

import math
import re
import tempfile
import time
from typing import Callable, Dict, Optional

from recloss import aot
from recloss_plugins.config import dump_config
from recloss_plugins.sasrec import parallel
from recloss_plugins.sasrec.eval import eval_batch_rows
from recloss_plugins.sasrec.program import build_program


def vocab_size_for(cfg) -> int:
    if cfg.vocab_size:
        return cfg.vocab_size
    if cfg.dataset_type == "synthetic":
        return cfg.synthetic_num_items + 1
    raise parallel.MeshError("compile_topology needs vocab_size > 0 for file datasets")


def compile_step(cfg, devices, vocab: int, batch_size: Optional[int] = None, dump_to: Optional[str] = None):
    """(compiled train step, memory report dict, Program) on ``devices``. With ``dump_to`` (a folder)
    XLA also writes the compiled module and its buffer analysis there (`recloss.aot.read`)."""
    mesh = parallel.build_mesh(cfg, devices, num_slices=cfg.compile_topology_num_slices)
    program = build_program(cfg, mesh, vocab, batch_size=batch_size)
    options = None if dump_to is None else aot.dump_options(dump_to)
    compiled = program.lowered_train_step().compile(compiler_options=options)
    return compiled, aot.memory_report(compiled), program


def compile_eval(program, dump_to: Optional[str] = None):
    """(compiled evaluation program, memory report dict): `Program.eval_top_k` for one batch of
    ``eval_batch_size`` users (rounded up to the batch shards) with the run's parameter shardings."""
    import jax
    import jax.numpy as jnp

    cfg, layout = program.cfg, program.layout
    users = eval_batch_rows(cfg.eval_batch_size, layout.batch_shards)
    sharded = lambda ndim: jax.sharding.NamedSharding(program.mesh, layout.batch_spec(ndim))
    args = (program.abstract_state["params"],
            jax.ShapeDtypeStruct((users, cfg.max_seq_len), jnp.int32, sharding=sharded(2)),
            jax.ShapeDtypeStruct((users,), jnp.int32, sharding=sharded(1)))
    options = None if dump_to is None else aot.dump_options(dump_to)
    compiled = program.eval_top_k.lower(*args).compile(compiler_options=options)
    return compiled, aot.memory_report(compiled)


def compile_oom(err: Exception) -> Optional[str]:
    """The compiler's words when ``err`` is a compile-time HBM OOM ("Used 31.28G of 31.25G
    hbm", or the error's first line naming it, at most `OOM_WORDS` characters), else None."""
    text = str(err)
    if "RESOURCE_EXHAUSTED" not in text and "HbmOom" not in text:
        return None
    m = re.search(r"Used [0-9.]+[KMGT]i?B? of [0-9.]+[KMGT]i?B? hbm", text)
    if m:
        return m.group(0)
    # Other wordings (a chip's own compile): its first line that names the failure, cut to OOM_WORDS.
    line = next((x.strip() for x in text.splitlines() if "RESOURCE_EXHAUSTED" in x or "HbmOom" in x), text)
    return line if len(line) <= OOM_WORDS else line[:OOM_WORDS - 1] + "…"


OOM_WORDS = 400


def largest_fitting_batch(measure: Callable[[int], float], budget: float, unit: int, start: int,
                          limit: int = 1 << 16, capacity: Callable[[], float] = lambda: math.inf) -> int:
    """Largest multiple of ``unit`` b <= ``limit`` with measure(b) <= budget (measure increasing
    in b; inf = the compiler refused it).

    Doubles from ``start`` while batches fit, then narrows the bracket
    [last fit, first miss]: first by secant steps aimed at min(budget,
    capacity()) (per-chip memory is close to affine in the batch, so a guess
    and its neighbour usually settle it), then by bisection. Returns 0 when
    not even ``unit`` fits."""
    seen: Dict[int, float] = {}

    def fits(b):
        if b not in seen:
            seen[b] = measure(b)
        return seen[b] <= budget

    b = max(unit, start // unit * unit)
    lo, hi = 0, b
    if fits(b):
        lo, hi = b, None
        while hi is None:
            if lo * 2 > limit:
                return lo
            if fits(lo * 2):
                lo *= 2
            else:
                hi = lo * 2
    secant_tries = 3
    while hi - lo > unit:
        guess = None
        if secant_tries > 0:
            secant_tries -= 1
            guess = _secant(seen, lo, hi, min(budget, capacity()))
        secant = guess is not None
        if not secant:
            guess = (lo + hi) / 2
        mid = min(max(int(guess) // unit * unit, lo + unit), hi - unit)
        if fits(mid):
            lo = mid
            # A good secant guess is the answer or just below it: its neighbour settles it.
            if secant and mid + unit < hi and not fits(mid + unit):
                hi = mid + unit
        else:
            hi = mid
    return lo


def _secant(seen: Dict[int, float], lo: int, hi: int, budget: float) -> Optional[float]:
    """Where the line through two measured points reaches ``budget``: the bracket ends
    when both are finite, else the last two finite points at or below ``lo``."""
    if lo and math.isfinite(seen[hi]):
        (b0, v0), (b1, v1) = (lo, seen[lo]), (hi, seen[hi])
    else:
        below = sorted(b for b, v in seen.items() if b <= lo and math.isfinite(v))
        if len(below) < 2:
            return None if lo else (hi * budget / seen[hi] if math.isfinite(seen[hi]) else None)
        (b0, v0), (b1, v1) = (below[-2], seen[below[-2]]), (below[-1], seen[below[-1]])
    slope = (v1 - v0) / (b1 - b0)
    if slope <= 0:
        return None
    return b1 + (budget - v1) / slope


def compile_report(cfg, log=print) -> Dict[str, object]:
    """Compiles for cfg.compile_topology and prints per-chip memory; returns the numbers."""
    aot.libtpu_env()   # before libtpu loads: no "unexpected worker hostname" off a TPU VM
    log("config:\n" + "\n".join(f"  {line}" for line in dump_config(cfg).splitlines()))
    devices = parallel.topology_devices(cfg.compile_topology, cfg.compile_topology_num_slices)
    vocab = vocab_size_for(cfg)
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="recloss-aot-") as dump:
        compiled, rep, program = compile_step(cfg, devices, vocab, dump_to=dump)
        top = aot.read(dump)
        xla = aot.hbm_bytes(dump)
    gib = rep.get("total", float("nan")) / 2**30
    log(f"compiled the train step for {cfg.compile_topology} ({len(devices)} chips, "
        f"{devices[0].device_kind}) in {time.perf_counter() - t0:.1f}s: loss={cfg.loss}, mesh "
        f"{dict(program.mesh.shape)}, V={vocab} ({program.rows} rows), D={cfg.emb_dim}, N={cfg.max_seq_len}, "
        f"global batch {program.batch_size} ({program.batch_size // program.layout.batch_shards} per batch shard)")
    log(parallel.describe_model_split(program.layout, program.model_batch_axes, program.batch_size))
    if program.gather is not None:
        log(program.gather.describe())
    log(f"per-chip HBM: {aot.format_memory(rep)}; XLA's count {xla / 2**30:.3f} GiB")
    log(aot.report(top, top=5))
    t1 = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="recloss-aot-eval-") as dump:
        _, eval_rep = compile_eval(program, dump_to=dump)
        eval_xla = aot.hbm_bytes(dump)
    log(f"compiled the evaluation ({eval_batch_rows(cfg.eval_batch_size, program.layout.batch_shards)} users a batch, top-{cfg.eval_top_k} of {vocab - 1:,} "
        f"items) in {time.perf_counter() - t1:.1f}s; per-chip HBM: {aot.format_memory(eval_rep)}; XLA's count "
        f"{eval_xla / 2**30:.3f} GiB")
    out = {"total_gib": gib, "memory": rep, "xla_bytes": xla, "global_batch_size": program.batch_size,
           "buffers": top, "eval_memory": eval_rep, "eval_xla_bytes": eval_xla}
    if cfg.compile_fit_hbm_gib > 0:
        budget = cfg.compile_fit_hbm_gib * 2**30
        seen = {}

        cap = {"bytes": math.inf}

        def measure(b):
            try:
                _, r, _ = compile_step(cfg, devices, vocab, batch_size=b)
                total, note = r["total"], ""
            except Exception as err:  # XLA:TPU refuses programs larger than the chip's HBM
                oom = compile_oom(err)
                if oom is None:
                    raise
                total, note = float("inf"), f" (compile-time OOM: {oom})"
                m = re.search(r"of ([0-9.]+)G", oom)
                if m:
                    cap["bytes"] = min(cap["bytes"], float(m.group(1)) * 2**30)
            seen[b] = total / 2**30
            log(f"  global batch {b}: {seen[b]:.2f} GiB per chip{note} -> "
                f"{'fits' if total <= budget else 'too big'}")
            return total

        # Multiples of what the batch is split over: with the vocab axis among them every batch tried
        # splits the model the same way, so memory stays monotonic in the batch.
        unit = math.prod(program.mesh.shape[a] for a in program.model_batch_axes)
        best = largest_fitting_batch(measure, budget, unit, program.batch_size, capacity=lambda: cap["bytes"])
        log(f"largest global batch fitting {cfg.compile_fit_hbm_gib:g} GiB per chip: {best} "
            f"(multiples of {unit}; {len(seen)} compiles)")
        out.update(largest_batch=best, searched=seen)
    return out
