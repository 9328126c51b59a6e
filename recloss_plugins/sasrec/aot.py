"""Ahead-of-time compilation of the train step for a TPU topology (like MaxText's train_compile).

    recloss-train configs/sasrec_yambda.yml compile_topology=v6e-8 loss=cutbce_pallas

Builds the mesh on the topology's devices (libtpu describes them; no TPU
needed), lowers and compiles the full train step (forward, loss, backward,
AdamW update) with the run's shardings, and prints the per-chip memory of the
compiled program. With ``compile_fit_hbm_gib`` > 0 it also finds the largest
global batch (a multiple of the batch shards) whose step fits that budget.
"""

from __future__ import annotations

import time
from typing import Callable, Dict, Optional

from recloss_plugins.config import dump_config
from recloss_plugins.sasrec import parallel
from recloss_plugins.sasrec.program import build_program, format_memory, memory_report


def vocab_size_for(cfg) -> int:
    if cfg.vocab_size:
        return cfg.vocab_size
    if cfg.dataset_type == "synthetic":
        return cfg.synthetic_num_items + 1
    raise parallel.MeshError("compile_topology needs vocab_size > 0 for file datasets")


def compile_step(cfg, devices, vocab: int, batch_size: Optional[int] = None):
    """(compiled train step, memory report dict, Program) on ``devices``."""
    mesh = parallel.build_mesh(cfg, devices, num_slices=cfg.compile_topology_num_slices)
    program = build_program(cfg, mesh, vocab, batch_size=batch_size)
    lowered = program.train_step.lower(program.abstract_state, program.abstract_batch())
    compiled = lowered.compile()
    return compiled, memory_report(compiled), program


def largest_fitting_batch(measure: Callable[[int], float], budget: float, unit: int, start: int,
                          limit: int = 1 << 16) -> int:
    """Largest multiple of ``unit`` b <= ``limit`` with measure(b) <= budget (measure increasing in b).

    Doubles from ``start`` while batches fit, then narrows the bracket
    [last fit, first miss]: first by secant steps (per-chip memory is close to
    affine in the batch, so a guess and its neighbour usually settle it), then
    by bisection. Returns 0 when not even ``unit`` fits."""
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
        if secant_tries > 0:
            secant_tries -= 1
            m_lo = seen[lo] if lo else 0.0
            guess = lo + (budget - m_lo) * (hi - lo) / max(seen[hi] - m_lo, 1e-9)
        else:
            guess = (lo + hi) / 2
        mid = min(max(int(guess) // unit * unit, lo + unit), hi - unit)
        if fits(mid):
            lo = mid
            if secant_tries >= 0 and mid + unit < hi and not fits(mid + unit):
                hi = mid + unit
        else:
            hi = mid
    return lo


def compile_report(cfg, log=print) -> Dict[str, object]:
    """Compiles for cfg.compile_topology and prints per-chip memory; returns the numbers."""
    log("config:\n" + "\n".join(f"  {line}" for line in dump_config(cfg).splitlines()))
    devices = parallel.topology_devices(cfg.compile_topology, cfg.compile_topology_num_slices)
    vocab = vocab_size_for(cfg)
    t0 = time.perf_counter()
    compiled, rep, program = compile_step(cfg, devices, vocab)
    gib = rep.get("total", float("nan")) / 2**30
    log(f"compiled the train step for {cfg.compile_topology} ({len(devices)} chips, "
        f"{devices[0].device_kind}) in {time.perf_counter() - t0:.1f}s: loss={cfg.loss}, mesh "
        f"{dict(program.mesh.shape)}, V={vocab} ({program.rows} rows), D={cfg.emb_dim}, N={cfg.max_seq_len}, "
        f"global batch {program.batch_size} ({program.batch_size // program.layout.batch_shards} per batch shard)")
    log(f"per-chip HBM: {format_memory(rep)}")
    out = {"total_gib": gib, "memory": rep, "global_batch_size": program.batch_size}
    if cfg.compile_fit_hbm_gib > 0:
        budget = cfg.compile_fit_hbm_gib * 2**30
        seen = {}

        def measure(b):
            _, r, _ = compile_step(cfg, devices, vocab, batch_size=b)
            seen[b] = r["total"] / 2**30
            log(f"  global batch {b}: {seen[b]:.2f} GiB per chip -> "
                f"{'fits' if r['total'] <= budget else 'too big'}")
            return r["total"]

        unit = program.layout.batch_shards
        best = largest_fitting_batch(measure, budget, unit, program.batch_size)
        log(f"largest global batch fitting {cfg.compile_fit_hbm_gib:g} GiB per chip: {best} "
            f"(multiples of {unit}; {len(seen)} compiles)")
        out.update(largest_batch=best, searched=seen)
    return out
