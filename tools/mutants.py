"""`make mutants`: single-point mutants of recloss, and whether the first test tier catches each.

Each `Mutant` is one small change to the library (a comparison, an offset, a dropped term) of the
kind a slip of the hand makes. A run copies the working tree's files (tracked and untracked, not
ignored) into one clean tree per job, then for each mutant: writes it into its file, runs the tier-1
tests named to catch it (``pytest -x``, one process, ``RECLOSS_TEST_SEED`` = the run's seed), and puts
the file back. A mutant counts as caught only when a test failed against it and that same test, with
the same seed, passes on the unmutated tree (a control run after the mutants); otherwise it survived.

    python -m tools.mutants                    # one run, a fresh seed; appended to the record
    python -m tools.mutants --only sweep-mask-off-by-one,grid-mask-off-by-one --seed 7 --no-record
    python -m tools.mutants --list

The record (docs/figures/data/mutants.json) keeps the last `KEEP_RUNS` runs; docs/development.md
renders it (`format_table`): each mutant, where it is, the test that caught it, and in how many of
the runs. Not part of `.ci/run` (it would double the first tier's time); run it after changing a
sweep, the grid, the targets, the sharded paths or these tests.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import dataclasses
import datetime
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ElementTree
from pathlib import Path
from typing import Dict, List, Optional, Sequence, Tuple

ROOT = Path(__file__).resolve().parent.parent
RECORD = ROOT / "docs" / "figures" / "data" / "mutants.json"
KEEP_RUNS = 3
# The tests a mutant runs for at most this long (then it counts as survived, and the record says so).
TIMEOUT_S = 300


@dataclasses.dataclass(frozen=True)
class Mutant:
    """One single-point change: ``old`` (text found exactly once in ``path``) becomes ``new``."""
    name: str
    area: str            # sweeps, grid, tiling, targets, sharding, ring, rows, kernels, sampled
    path: str            # relative to the repository root
    old: str
    new: str
    what: str            # the defect, in words
    tests: Tuple[str, ...]   # pytest node ids or files: the tier-1 tests that should catch it, likeliest first


B = "tests/test_boundaries.py::"
COL = B + "test_column_and_row_boundaries_on_one_device"
SHARD = B + "test_shard_edges_under_every_gather"

MUTANTS: Tuple[Mutant, ...] = (
    # --------------------------------------------------------------- the pure-JAX sweep (recloss/sweep.py)
    Mutant("sweep-mask-off-by-one", "sweeps", "recloss/sweep.py",
           "mask = static_offset is None or static_offset + v_local > vocab_size",
           "mask = static_offset is None or static_offset + v_local > vocab_size + 1",
           "a static shard with exactly one padding row is not masked",
           (f"{COL}[rows=V+1,whole-blocks-cutbce]", f"{COL}[rows=V+1,whole-blocks-cutce]")),
    Mutant("sweep-live-includes-V", "sweeps", "recloss/sweep.py",
           "live = (col0 + jnp.arange(e_j.shape[0]) + vocab_offset < blk.vocab_size)[None, :]",
           "live = (col0 + jnp.arange(e_j.shape[0]) + vocab_offset <= blk.vocab_size)[None, :]",
           "the first padding column (id V) counts as live",
           (f"{COL}[rows=V+block-cutbce]", f"{COL}[rows=V+block-cutce]")),
    Mutant("sweep-tail-col0", "sweeps", "recloss/sweep.py",
           "carry, last = block(carry, e[nb * bv:], None if b is None else b[nb * bv:], nb * bv)",
           "carry, last = block(carry, e[nb * bv:], None if b is None else b[nb * bv:], nb * bv + 1)",
           "the tail block's columns are numbered from one past its first",
           (f"{COL}[partial-last-block-cutce]", f"{COL}[partial-last-block-cutbce]",
            f"{COL}[rows=V+1,tail-of-one-cutbce]")),
    Mutant("sweep-last-row-tile-dropped", "sweeps", "recloss/sweep.py",
           "c, _ = jax.lax.scan(sub, start, jnp.arange(mp // bn))",
           "c, _ = jax.lax.scan(sub, start, jnp.arange(max(1, mp // bn - 1)))",
           "the last row tile of each vocab block is skipped",
           (f"{COL}[rows=V+1,whole-blocks-cutbce]", f"{COL}[rows=V+1,whole-blocks-cutce]")),
    Mutant("sweep-sparse-term-unscaled", "sweeps", "recloss/sweep.py",
           "g = jnp.where(sp.valid, dx * r[:, None], 0.0)",
           "g = jnp.where(sp.valid, dx, 0.0)",
           "the target term's gradient inside a sweep ignores the row scale",
           (B + "test_a_16_bit_table_within_the_stated_bound[cutbce-bias-one-tile]",
            f"{SHARD}[data2-fsdp2-vocab2-cutbce-ring]")),
    Mutant("sweep-backward-ignores-cotangent", "sweeps", "recloss/sweep.py",
           "ga, ge, gb = cast_grads(a, shard.table, shard.bias, da, de, db, g)",
           "ga, ge, gb = cast_grads(a, shard.table, shard.bias, da, de, db, 1.0)",
           "a scalar loss's backward drops its cotangent (right only for d(loss)/d(loss) = 1)",
           (f"{COL}[rows=V-cutbce]",)),
    # --------------------------------------------------------------- the Pallas grid (recloss/pallas/grid.py)
    Mutant("grid-mask-off-by-one", "grid", "recloss/pallas/grid.py",
           "mask_cols = (v % t.bv != 0 or static_offset is None or static_offset + v > vocab_size)",
           "mask_cols = (v % t.bv != 0 or static_offset is None or static_offset + v > vocab_size + 1)",
           "a kernel over whole blocks with exactly one padding row does not mask",
           (f"{COL}[rows=V+1,whole-blocks-cutbce_pallas]", f"{COL}[rows=V+1,whole-blocks-cutce_pallas]")),
    Mutant("grid-live-ignores-shard-end", "grid", "recloss/pallas/grid.py",
           "live = (cols < v_local) & (cols + off_ref[0] < vocab_size)",
           "live = cols + off_ref[0] < vocab_size",
           "a partial last block's columns past the shard's rows count as live",
           (f"{SHARD}[vocab4-cutbce_pallas-once]", f"{SHARD}[vocab4-cutce_pallas-once]")),
    Mutant("grid-live-includes-V", "grid", "recloss/pallas/grid.py",
           "live = (cols < v_local) & (cols + off_ref[0] < vocab_size)",
           "live = (cols < v_local) & (cols + off_ref[0] <= vocab_size)",
           "the first padding column (id V) counts as live in a kernel",
           (f"{COL}[rows=V+block-cutbce_pallas]", f"{COL}[rows=V+block-cutce_pallas]")),
    Mutant("bce-kernel-count-counts-dead-columns", "kernels", "recloss/bce/kernel.py",
           "hit = out.positive          #",
           "hit = out.positive | (st.x > 0.0)          #",
           "the predicted-positive count at threshold 0 takes dead columns' logits",
           (f"{SHARD}[vocab4-cutbce_pallas-once]", f"{SHARD}[data2-fsdp2-vocab2-cutbce_pallas-once]")),
    Mutant("grid-tail-rows-unmasked", "grid", "recloss/pallas/grid.py",
           "e_blk = jnp.where(row < v_local, e_blk, jnp.zeros_like(e_blk))",
           "e_blk = jnp.where(row < v_local + 1, e_blk, jnp.zeros_like(e_blk))",
           "one unspecified row past a partial last block is read",
           (f"{COL}[partial-last-block-cutbce_pallas]", f"{COL}[rows=V+1,tail-of-one-cutbce_pallas]",
            f"{COL}[partial-last-block-cutce_pallas]")),
    Mutant("grid-chunks-not-accumulated", "grid", "recloss/pallas/grid.py",
           'acc[...] = (ref["de_in"][...] if accumulate else jnp.zeros(acc.shape, jnp.float32))',
           'acc[...] = jnp.zeros(acc.shape, jnp.float32)',
           "dE of earlier row chunks is overwritten, not added to",
           (f"{COL}[rows=V+1,whole-blocks-cutbce_pallas]", f"{COL}[rows=V+1,whole-blocks-cutce_pallas]")),
    Mutant("grid-two-core-skip-ignored", "grid", "recloss/pallas/grid.py",
           "pl.when(jg < g.nb)(step)",
           "step()",
           "a two-core grid's empty last step re-adds the last block",
           ("tests/test_bce_pallas.py::test_two_core_split", "tests/test_softmax_pallas.py::test_two_core_split")),
    Mutant("grid-row-scale-not-on-a", "grid", "recloss/pallas/grid.py",
           "a_s = (a_s.astype(jnp.float32) * rs).astype(a_s.dtype)",
           "a_s = a_s.astype(a_s.dtype)",
           "a float32 kernel's dE misses G's row scale (taken off G, put on dA only)",
           ("tests/test_bce_pallas.py::test_matches_oracle_and_cutbce_odd_shapes[False]",)),
    Mutant("grid-row-scale-with-a-bias", "grid", "recloss/pallas/grid.py",
           "if rs is not None and (has_bias or jnp.dtype(g.cdt) != jnp.float32):",
           "if rs is not None and jnp.dtype(g.cdt) != jnp.float32:",
           "a float32 kernel with a bias takes G's row scale off G, so db sums G unscaled",
           ("tests/test_bce_pallas.py::test_matches_oracle_and_cutbce_odd_shapes[True]",)),
    Mutant("grid-pairs-block-start", "grid", "recloss/pallas/grid.py",
           "starts = jnp.searchsorted(pid, jnp.arange(nb + 1, dtype=jnp.int32) * bv).astype(jnp.int32)",
           "starts = jnp.searchsorted(pid, jnp.arange(nb + 1, dtype=jnp.int32) * bv, side='right').astype(jnp.int32)",
           "a 16-bit target term at a block's first column goes to the block before",
           (B + "test_a_16_bit_table_within_the_stated_bound[cutbce_pallas-bias-one-tile]",
            B + "test_a_16_bit_table_within_the_stated_bound[cutbce_pallas-no-bias-one-tile]")),
    Mutant("grid-pairs-wrong-row", "grid", "recloss/pallas/grid.py",
           "pick = jax.lax.broadcasted_iota(jnp.int32, (sub, 1), 0) == row - base",
           "pick = jax.lax.broadcasted_iota(jnp.int32, (sub, 1), 0) == (row - base + 1) % sub",
           "a 16-bit target term takes its neighbour row's hidden state",
           (B + "test_a_16_bit_table_within_the_stated_bound[cutbce_pallas-no-bias-one-tile]",)),
    Mutant("bce-kernel-16-bit-chunks-rounded-twice", "kernels", "recloss/bce/kernel.py",
           "        de, db = sweep_lib.add_sparse_de(a, de, db, sparse_de)",
           "        de, db = sweep_lib.add_sparse_de(a, None if de is None else de.astype(e.dtype), db, sparse_de)",
           "a 16-bit table's dE over row chunks is rounded before the target term is added",
           ("tests/test_bce.py::test_a_16_bit_tables_gradient_is_rounded_once",)),
    # --------------------------------------------------------------- tiling (recloss/pallas/tiling.py)
    Mutant("tiling-resident-tile-not-whole-sub-tiles", "tiling", "recloss/pallas/tiling.py",
           "one = _round_up(p.m_pad, bs)",
           "one = p.m_pad",
           "a resident row tile that is not a whole number of sub-tiles (its last rows never computed)",
           (B + "test_automatic_tiles_one_row_past_a_512_row_sub_tile[cutbce_pallas]",
            B + "test_automatic_tiles_one_row_past_a_512_row_sub_tile[cutce_pallas]")),
    Mutant("tiling-chunks-rounded-down", "tiling", "recloss/pallas/tiling.py",
           "chunks = math.ceil(p.m / bn) if p.m else 1",
           "chunks = max(1, p.m // bn) if p.m else 1",
           "one row past whole row chunks gets no chunk",
           (f"{COL}[rows=V+1,whole-blocks-cutbce_pallas]", f"{COL}[rows=V+1,whole-blocks-cutce_pallas]")),
    # --------------------------------------------------------------- targets (recloss/targets.py)
    Mutant("targets-unsorted", "targets", "recloss/targets.py",
           "ids = jnp.sort(targets.astype(jnp.int32), axis=-1)",
           "ids = targets.astype(jnp.int32)",
           "repeats that are not adjacent count twice",
           (B + "test_duplicates_that_are_not_adjacent_count_once[cutbce]",
            B + "test_duplicates_that_are_not_adjacent_count_once[cutce]")),
    Mutant("targets-shard-end-owned", "targets", "recloss/targets.py",
           "valid = valid & (local >= 0) & (local < v_local)",
           "valid = valid & (local >= 0) & (local <= v_local)",
           "the next shard's first id is also owned here",
           (f"{SHARD}[vocab4-cutbce-once]", f"{SHARD}[vocab4-cutce-once]")),
    Mutant("targets-V-valid", "targets", "recloss/targets.py",
           "return ids, first & (ids != pad_id) & (ids >= 0) & (ids < vocab_size)",
           "return ids, first & (ids != pad_id) & (ids >= 0) & (ids <= vocab_size)",
           "id V (a padding row that exists) counts as a target",
           (f"{COL}[rows=V+block-cutbce]", f"{COL}[rows=V+block-cutce]")),
    Mutant("targets-V-not-invalid", "targets", "recloss/targets.py",
           "bad = (t != pad_id) & ((t < 0) | (t >= vocab_size))",
           "bad = (t != pad_id) & ((t < 0) | (t > vocab_size))",
           "id V is not counted as invalid",
           (f"{COL}[rows=V-cutbce]",)),
    Mutant("targets-scatter-chunk-short", "targets", "recloss/targets.py",
           "return [slice(i, i + SCATTER_ROWS) for i in range(0, m, SCATTER_ROWS)]",
           "return [slice(i, i + SCATTER_ROWS - 1) for i in range(0, m, SCATTER_ROWS)]",
           "each chunk of the target gradient's scatter drops its last row",
           ("tests/test_targets.py::test_gather_logits_vjp_equals_autodiff",)),
    # --------------------------------------------------------------- sharding (recloss/sharding.py, shard.py)
    Mutant("sharding-vocab-offset", "sharding", "recloss/sharding.py",
           "offset = 0 if vocab_axis is None else jax.lax.axis_index(vocab_axis) * v_local",
           "offset = 0 if vocab_axis is None else jax.lax.axis_index(vocab_axis) * (v_local - 1)",
           "vocab shards overlap by one id",
           (f"{SHARD}[vocab4-cutbce-once]", f"{SHARD}[vocab4-dense_ce-once]")),
    Mutant("sharding-column-sum-includes-V", "sharding", "recloss/shard.py",
           "live = (jnp.arange(table.shape[0]) + vocab_offset < vocab_size)[:, None]",
           "live = (jnp.arange(table.shape[0]) + vocab_offset <= vocab_size)[:, None]",
           "label smoothing's column sum takes the first padding row",
           (f"{COL}[rows=V+1,whole-blocks-cutce]", f"{SHARD}[vocab4-cutce-once]")),
    Mutant("sharding-invalid-not-summed", "sharding", "recloss/assemble.py",
           "invalid = shard.batch_sum(targets_lib.invalid_count(targets, opts.pad_id, vocab_size))",
           "invalid = targets_lib.invalid_count(targets, opts.pad_id, vocab_size)",
           "invalid ids are counted on one batch shard only",
           (f"{SHARD}[data2-fsdp2-vocab2-cutbce-once]",)),
    # --------------------------------------------------------------- the rows gather
    Mutant("rows-slice-offset", "rows", "recloss/sharding.py",
           "offset = offset + jax.lax.axis_index(fsdp_axis) * slice_rows",
           "offset = offset + jax.lax.axis_index(fsdp_axis) * (slice_rows - 1)",
           "under the rows gather each chip's slice starts one id early per fsdp index",
           (f"{SHARD}[data2-fsdp2-vocab2-cutbce-rows]", f"{SHARD}[data2-fsdp2-vocab2-cutce-rows]")),
    Mutant("rows-per-row-loss-slice", "rows", "recloss/sharding.py",
           "out = LossOutput(jax.lax.dynamic_slice_in_dim(out.loss, jax.lax.axis_index(axis) * m, m), out.metrics)",
           "out = LossOutput(jax.lax.dynamic_slice_in_dim(out.loss, 0, m), out.metrics)",
           "a per-row loss under the rows gather returns the group's first chip's rows",
           ("tests/test_ring.py::test_cutbce_rows_per_row_loss",)),
    # --------------------------------------------------------------- the ring (recloss/ring.py)
    Mutant("ring-held-slice", "ring", "recloss/ring.py",
           "return (self.index() - s) % self.size",
           "return (self.index() + s) % self.size",
           "the slice a chip holds is named as if the ring turned the other way",
           ("tests/test_ring.py::test_cutbce_ring_equals_single_device", f"{SHARD}[data2-fsdp2-vocab2-cutbce-ring]")),
    Mutant("ring-slice-end-owned", "ring", "recloss/ring.py",
           "own = valid & (loc >= 0) & (loc < rows)",
           "own = valid & (loc >= 0) & (loc <= rows)",
           "a target at the next slice's first id is also owned by this slice",
           (f"{SHARD}[data2-fsdp2-vocab2-cutbce-ring]", f"{SHARD}[data2-fsdp2-vocab2-cutce-ring]")),
    Mutant("ring-argmax-ties", "ring", "recloss/ring.py",
           "take = (m1 > m0) | ((m1 == m0) & (i1 < i0))",
           "take = (m1 > m0) | ((m1 == m0) & (i1 > i0))",
           "a tie between slices goes to the larger id",
           (f"{SHARD}[data2-fsdp2-vocab2-cutce-ring]", f"{SHARD}[data2-fsdp2-vocab2-cutce_pallas-ring]")),
    # --------------------------------------------------------------- the kernels' math
    Mutant("bce-kernel-counts-padding", "kernels", "recloss/bce/kernel.py",
           "                    hit = hit & st.live\n",
           "                    hit = hit\n",
           "the kernel counts predicted positives in padding columns",
           (f"{COL}[rows=V+block-cutbce_pallas]", f"{COL}[rows=V+1,whole-blocks-cutbce_pallas]")),
    Mutant("bce-kernel-16-bit-bias-correction-dropped", "kernels", "recloss/bce/kernel.py",
           "            db = db.at[sparse_de[0].reshape(-1)].add(sparse_de[1].reshape(-1))",
           "            db = db",
           "a 16-bit one-tile kernel drops the target term's bias gradient",
           (B + "test_a_16_bit_table_within_the_stated_bound[cutbce_pallas-bias-one-tile]",)),
    Mutant("bce-term-dead-columns-at-zero", "kernels", "recloss/bce/bernoulli.py",
           "            x = jnp.where(live, x, -jnp.inf)",
           "            x = jnp.where(live, x, 0.0)",
           "the kernel term takes a dead column as a logit of 0 (log 2 and sigma = 1/2), not as none",
           (f"{COL}[rows=V+block-cutbce_pallas]", f"{COL}[partial-last-block-cutbce_pallas]")),
    Mutant("bce-term-reciprocal-unrefined", "kernels", "recloss/bce/bernoulli.py",
           "            for _ in range(newton):",
           "            for _ in range(newton - 2):",
           "the kernel term's approximate reciprocal (sigma) is not refined",
           (f"{COL}[rows=V-cutbce_pallas]", f"{COL}[partial-last-block-cutbce_pallas]")),
    Mutant("bce-kernel-one-newton-step-beside-a-bias", "kernels", "recloss/bce/kernel.py",
           "    return 1 if not bias and (sixteen or one_pass) else 2",
           "    return 1 if sixteen or one_pass else 2",
           "sigma takes one Newton step where a bias gradient sums G in float32",
           ("tests/test_bce_pallas.py::test_sigma_takes_one_newton_step_only_where_its_gradient_is_rounded_to_16_bits",)),
    Mutant("bce-kernel-one-newton-step-in-the-interpreter", "kernels", "recloss/bce/kernel.py",
           "    one_pass = grid.dot_precision(cdt) == jax.lax.Precision.DEFAULT and not interpret",
           "    one_pass = grid.dot_precision(cdt) == jax.lax.Precision.DEFAULT",
           "sigma takes one Newton step where the interpreter's float32 products are exact",
           ("tests/test_bce_pallas.py::test_sigma_takes_one_newton_step_only_where_its_gradient_is_rounded_to_16_bits",)),
    Mutant("bce-term-small-lanes-by-log", "kernels", "recloss/bce/bernoulli.py",
           "    return jnp.where(q < 2.0 ** -4, series, y)",
           "    return y",
           "the kernel term takes a small lane's log1p as the log of 1 + q (2^-24 absolute, not relative)",
           ("tests/test_bce_pallas.py::test_the_terms_tile_keeps_small_terms_to_float32_relative[lone]",)),
    Mutant("bce-term-lane-product-restarts", "kernels", "recloss/bce/bernoulli.py",
           "                q = q * d_g + e_g",
           "                q = e_g",
           "the kernel term's log of the lane groups' product keeps only the last group",
           (B + "test_automatic_tiles_one_row_past_a_512_row_sub_tile[cutbce_pallas]",)),
    Mutant("softmax-kernel-argmax-ties", "kernels", "recloss/softmax/kernel.py",
           "                better = xk > best",
           "                better = xk >= best",
           "a tie within a row goes to the later column",
           ("tests/test_softmax_pallas.py::test_argmax_ties_go_to_the_smallest_id",)),
    Mutant("softmax-kernel-lane-group-dropped", "kernels", "recloss/softmax/kernel.py",
           "        for xk in groups[1:]:\n            acc = acc + jnp.exp(xk - m_new)",
           "        for xk in groups[2:]:\n            acc = acc + jnp.exp(xk - m_new)",
           "the softmax kernel's sum-exp leaves out a vocab block's second group of 128 columns",
           (B + "test_automatic_tiles_one_row_past_a_512_row_sub_tile[cutce_pallas]",)),
    Mutant("grid-lane-fold-drops-a-group", "grid", "recloss/pallas/grid.py",
           "    for k in range(1, x.shape[1] // tiling.LANES):",
           "    for k in range(2, x.shape[1] // tiling.LANES):",
           "a kernel's per-row sums leave out a vocab block's second group of 128 columns",
           (B + "test_automatic_tiles_one_row_past_a_512_row_sub_tile[cutbce_pallas]",)),
    Mutant("softmax-lanes-argmax-largest-id", "kernels", "recloss/softmax/kernel.py",
           "idx = jnp.min(jnp.where(m_l == m[:, None], res.lanes(\"id\"), partition.BIG_ID), axis=-1)",
           "idx = jnp.max(jnp.where(m_l == m[:, None], res.lanes(\"id\"), -1), axis=-1)",
           "a tie across the kernel's lanes goes to the larger id",
           ("tests/test_softmax_pallas.py::test_argmax_ties_go_to_the_smallest_id",)),
    Mutant("softmax-blocks-argmax-ties", "sweeps", "recloss/softmax/cut.py",
           'out["id"] = jnp.where(new["m"] > old["m"], new["id"], old["id"])',
           'out["id"] = jnp.where(new["m"] >= old["m"], new["id"], old["id"])',
           "a tie between vocab blocks goes to the later block",
           (f"{COL}[rows=V-cutce]", f"{COL}[partial-last-block-cutce]", f"{COL}[rows=V+block-cutce]")),
    Mutant("bce-cut-16-bit-rounded-twice", "sweeps", "recloss/bce/cut.py",
           'de, db = sweep_lib.add_sparse_de(a, outs.get("de"), outs.get("db"), sparse_de)',
           'de, db = sweep_lib.add_sparse_de(a, None if "de" not in outs else outs["de"].astype(e.dtype), '
           'outs.get("db"), sparse_de)',
           "a 16-bit table's background dE is rounded before the target term is added",
           ("tests/test_bce.py::test_a_16_bit_tables_gradient_is_rounded_once",)),
    Mutant("dense-bce-live-includes-V", "kernels", "recloss/bce/dense.py",
           "live = (jnp.arange(v_local) + vocab_offset) < vocab_size",
           "live = (jnp.arange(v_local) + vocab_offset) <= vocab_size",
           "the dense BCE baseline counts the first padding column",
           (f"{COL}[rows=V+block-dense_bce]", f"{COL}[rows=V+1,whole-blocks-dense_bce]")),
    Mutant("dense-ce-live-includes-V", "kernels", "recloss/softmax/dense.py",
           "live = (cols < vocab_size)[None, :]",
           "live = (cols <= vocab_size)[None, :]",
           "the dense softmax baseline counts the first padding column",
           (f"{COL}[rows=V+block-dense_ce]", f"{COL}[rows=V+1,whole-blocks-dense_ce]")),
    Mutant("metrics-true-negatives-vocab", "kernels", "recloss/metrics.py",
           "out.update(tp=tp, fp=fp, fn=fn, tn=weight_sum * float(vocab_size) - tp - fp - fn)",
           "out.update(tp=tp, fp=fp, fn=fn, tn=weight_sum * float(vocab_size + 1) - tp - fp - fn)",
           "true negatives counted over V + 1 columns",
           (f"{COL}[rows=V-cutbce]",)),
    Mutant("softmax-grad-temperature", "kernels", "recloss/softmax/kernel.py",
           'rows = [("r", r * inv_t if inv_t != 1.0 else r, 0.0), ("lse", lse, big)]',
           'rows = [("r", r, 0.0), ("lse", lse, big)]',
           "the softmax kernel's recompute forgets the temperature's 1/τ",
           (f"{COL}[rows=V+block-cutce_pallas]",)),
    Mutant("ring-column-sum-slice-offset", "ring", "recloss/shard.py",
           "return _column_sum(hidden, self.table, self.bias, self.offset + self.ring.index() * self.ring.rows,",
           "return _column_sum(hidden, self.table, self.bias, self.offset,",
           "a ring slice's column sum masks as if it were the vocab shard's first slice",
           (f"{SHARD}[data2-fsdp2-vocab2-cutce-ring]", f"{SHARD}[data2-fsdp2-vocab2-cutce_pallas-ring]")),
    Mutant("kernel-sub-tiles-one-short", "grid", "recloss/pallas/grid.py",
           "jax.lax.fori_loop(0, nsub, sub_tile, 0)",
           "jax.lax.fori_loop(0, max(1, nsub - 1), sub_tile, 0)",
           "a kernel's last row sub-tile is skipped",
           (B + "test_automatic_tiles_one_row_past_a_512_row_sub_tile[cutbce_pallas]",
            B + "test_automatic_tiles_one_row_past_a_512_row_sub_tile[cutce_pallas]")),
    Mutant("sampled-in-batch-own-targets", "sampled", "recloss/sampled/strategies.py",
           "live = jnp.concatenate([live, (cand >= 0)[None, :] & ~candidates.hits(gids, gvalid, cand)], axis=-1)",
           "live = jnp.concatenate([live, (cand >= 0)[None, :] & jnp.ones_like(live[:, :1])], axis=-1)",
           "a position's own targets enter its in-batch negatives",
           (B + "test_sampled_shard_edges_under_vocab_sharding[sampled_softmax-vocab4]",)),
    Mutant("sweep-row-tiles-overwrite", "sweeps", "recloss/sweep.py",
           "                c[k] = c[k] + x",
           "                c[k] = x",
           "a vocab block's dE keeps only its last row tile's part",
           (f"{COL}[rows=V+1,whole-blocks-cutbce]", f"{COL}[rows=V+1,whole-blocks-cutce]")),
    Mutant("grid-init-at-step-one", "grid", "recloss/pallas/grid.py",
           "        @pl.when(j == 0)",
           "        @pl.when(j == 1)",
           "a kernel's resident accumulators are set at its second vocab block, not its first",
           (f"{COL}[rows=V-cutbce_pallas]", f"{COL}[rows=V-cutce_pallas]")),
    Mutant("grid-gradient-of-dead-columns", "grid", "recloss/pallas/grid.py",
           "        if step.live is not None and (not clean or step.slope is not None):",
           "        if False:",
           "a kernel's gradient takes the dead columns of a tile that does not zero them itself",
           (f"{COL}[rows=V+1,whole-blocks-cutbce_pallas]", f"{COL}[rows=V+1,whole-blocks-cutce_pallas]")),
    Mutant("grid-pairs-rows-of-the-wrong-kind", "grid", "recloss/pallas/grid.py",
           "    prow = (order // l).astype(jnp.int32)",
           "    prow = (order % l).astype(jnp.int32)",
           "a 16-bit target term's rows are taken as its targets' places in the row",
           (B + "test_a_16_bit_table_within_the_stated_bound[cutbce_pallas-bias-one-tile]",)),
    Mutant("targets-local-ids-shifted", "targets", "recloss/targets.py",
           "    local = ids - vocab_offset\n",
           "    local = ids - vocab_offset + 1\n",
           "a target's row in its shard is one past it",
           (f"{COL}[rows=V-cutbce]", f"{COL}[rows=V-cutce]")),
    Mutant("bce-vocab-mean-divisor", "kernels", "recloss/bce/strategies.py",
           "vscale = 1.0 / vocab_size if",
           "vscale = 1.0 / (vocab_size + 1) if",
           "vocab_reduction='mean' divides by V + 1",
           (f"{COL}[rows=V-cutbce]",)),
    Mutant("softmax-global-argmax-largest", "sharding", "recloss/softmax/partition.py",
           "    return -shard.vocab_max(-cand)",
           "    return shard.vocab_max(jnp.where(cand == BIG_ID, -1, cand))",
           "a tie across vocab shards goes to the larger id",
           (f"{SHARD}[vocab4-cutce-once]", f"{SHARD}[vocab4-dense_ce-once]")),
    Mutant("softmax-shard-argmax-local-id", "sweeps", "recloss/softmax/cut.py",
           'out["id"] = (jnp.argmax(xm, axis=-1) + col0 + vocab_offset).astype(jnp.int32)',
           'out["id"] = (jnp.argmax(xm, axis=-1) + col0).astype(jnp.int32)',
           "a vocab shard's argmax is reported as a local id",
           (f"{SHARD}[vocab4-cutce-once]",)),
    Mutant("sharding-column-sum-bias-unmasked", "sharding", "recloss/shard.py",
           "        out = out + total(jnp.sum(jnp.where(live[:, 0], bias, 0), dtype=jnp.float32))",
           "        out = out + total(jnp.sum(bias, dtype=jnp.float32))",
           "label smoothing's column sum takes the padding rows' bias",
           (f"{COL}[rows=V+1,whole-blocks-cutce]", f"{SHARD}[vocab4-cutce-once]")),
    Mutant("rows-gather-keeps-fsdp-batch-sum", "rows", "recloss/sharding.py",
           "batch_axes, vocab_axes = tuple(a for a in batch_axes if a != fsdp_axis), vocab_axes + (fsdp_axis,)",
           "batch_axes, vocab_axes = tuple(batch_axes), vocab_axes + (fsdp_axis,)",
           "under the rows gather the fsdp group's rows are summed over fsdp again",
           (f"{SHARD}[data2-fsdp2-vocab2-cutbce-rows]", f"{SHARD}[data2-fsdp2-vocab2-cutce-rows]")),
    Mutant("ring-walk-one-slice-short", "ring", "recloss/ring.py",
           "jax.lax.fori_loop(1, self.size, body,",
           "jax.lax.fori_loop(1, self.size - 1, body,",
           "the ring visits one slice fewer than it holds",
           (f"{SHARD}[data2-fsdp2-vocab2-cutbce-ring]", f"{SHARD}[data2-fsdp2-vocab2-cutce-ring]")),
    Mutant("ring-slice-offset-by-step", "ring", "recloss/ring.py",
           "o = run(a, e_k, b_k, r, base + ring.held(s) * rows, inner, fwd",
           "o = run(a, e_k, b_k, r, base + s * rows, inner, fwd",
           "a visiting slice's first id is taken from the step, not the slice",
           (f"{SHARD}[data2-fsdp2-vocab2-cutbce-ring]", f"{SHARD}[data2-fsdp2-vocab2-cutce-ring]")),
    # --------------------------------------------------------------- the sampled losses
    Mutant("gbce-rate-off-by-one", "sampled", "recloss/sampled/candidates.py",
           "alpha = 1.0 if vocab_size <= 1 else min(1.0, num_negatives / (vocab_size - 1))",
           "alpha = 1.0 if vocab_size <= 1 else min(1.0, num_negatives / vocab_size)",
           "gBCE's sampling rate counts the catalogue, not the V − 1 ids a negative can be",
           (B + "test_gbce_sampling_rate_at_a_small_catalogue[K=5]",
            B + "test_gbce_sampling_rate_at_a_small_catalogue[K=V-1]")),
    Mutant("sampled-top1-ties", "sampled", "recloss/sampled/candidates.py",
           "return jnp.any(valid, axis=-1) & (best > rival)",
           "return jnp.any(valid, axis=-1) & (best >= rival)",
           "a target that only ties a live negative counts as a top-1 hit",
           (B + "test_sampled_negatives_at_block_and_catalogue_edges[gbce]",)),
    Mutant("sampled-candidate-shard-end", "sampled", "recloss/sampled/candidates.py",
           "own = (local >= 0) & (local < table.shape[0])",
           "own = (local >= 0) & (local <= table.shape[0])",
           "a candidate at the next shard's first id is also read here",
           (B + "test_sampled_shard_edges_under_vocab_sharding[gbce-vocab4]",)),
    Mutant("sampled-log-q-shard-end", "sampled", "recloss/sampled/sampler.py",
           "own = (local >= 0) & (local < self.shifted.shape[0])",
           "own = (local >= 0) & (local <= self.shifted.shape[0])",
           "log q of an id at the next shard's first row is also read here",
           (B + "test_sampled_shard_edges_under_vocab_sharding[sampled_softmax-vocab4]",)),
    Mutant("sampled-draw-shard-start", "sampled", "recloss/sampled/sampler.py",
           "start = cum[index] - masses[index]",
           "start = cum[index]",
           "a shard draws its rows against the wrong part of the CDF",
           ("tests/test_sampled.py::test_sharded_draw_is_q_and_the_same_on_every_shard",)),
)


def mutant_by_name() -> Dict[str, Mutant]:
    return {m.name: m for m in MUTANTS}


# ----------------------------------------------------------------------------- running
def tree_files(root: Path) -> List[str]:
    """The working tree's files a clean copy holds: tracked and untracked, not ignored."""
    out = subprocess.run(["git", "ls-files", "-co", "--exclude-standard", "-z"], cwd=root, check=True,
                         capture_output=True).stdout.decode()
    return [f for f in out.split("\0") if f and (root / f).is_file()]


def copy_tree(root: Path, dest: Path, files: Sequence[str]):
    for f in files:
        target = dest / f
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(root / f, target)


def apply(tree: Path, mutant: Mutant) -> str:
    """Writes ``mutant`` into its file in ``tree``; returns the original text (to put back)."""
    path = tree / mutant.path
    text = path.read_text()
    count = text.count(mutant.old)
    if count != 1:
        raise ValueError(f"mutant {mutant.name!r}: its text occurs {count} times in {mutant.path} (expected once); "
                         f"update tools/mutants.py to today's code:\n{mutant.old}")
    path.write_text(text.replace(mutant.old, mutant.new))
    return text


def _env(tree: Path, seed: int) -> dict:
    env = dict(os.environ, PYTHONPATH=str(tree), RECLOSS_TEST_SEED=str(seed), JAX_PLATFORMS="cpu",
               TPU_SKIP_MDS_QUERY="1", PYTHONDONTWRITEBYTECODE="1")
    env.pop("PYTEST_ADDOPTS", None)
    return env


def run_pytest(tree: Path, args: Sequence[str], seed: int, junit: Path, timeout: float = TIMEOUT_S):
    """(exit status or None on timeout, seconds, {node id: 'passed' | 'failed' | 'error' | 'skipped'},
    {node id: first line of its failure}) of ``pytest args`` in ``tree`` with ``seed``."""
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "no:randomly", "-n", "0",
           "-m", "tier1", "--tb=short", f"--junitxml={junit}", *args]
    t0 = time.perf_counter()
    try:
        proc = subprocess.run(cmd, cwd=tree, env=_env(tree, seed), capture_output=True, text=True, timeout=timeout)
        rc = proc.returncode
        tail = proc.stdout[-3000:] + proc.stderr[-2000:]
    except subprocess.TimeoutExpired:
        rc, tail = None, ""
    seconds = time.perf_counter() - t0
    results, messages = _junit(junit)
    if rc not in (0, 1, None) and not results:
        messages["<collection>"] = tail.strip().splitlines()[-1] if tail.strip() else f"pytest exit {rc}"
        results["<collection>"] = "error"
    return rc, seconds, results, messages


def _junit(path: Path):
    results, messages = {}, {}
    if not path.exists():
        return results, messages
    for case in ElementTree.parse(path).getroot().iter("testcase"):
        cls, name = case.get("classname", ""), case.get("name", "")
        file = cls.replace(".", "/") + ".py" if cls else ""
        node = f"{file}::{name}"
        status = "passed"
        for tag in ("failure", "error", "skipped"):
            el = case.find(tag)
            if el is not None:
                status = {"failure": "failed", "error": "error", "skipped": "skipped"}[tag]
                msg = (el.get("message") or el.text or "").strip().splitlines()
                messages[node] = msg[0][:300] if msg else ""
                break
        results[node] = status
    return results, messages


def run_mutant(tree: Path, mutant: Mutant, seed: int, work: Path) -> dict:
    original = apply(tree, mutant)
    try:
        rc, seconds, results, messages = run_pytest(tree, ["-x", *mutant.tests], seed, work / f"{mutant.name}.xml")
    finally:
        (tree / mutant.path).write_text(original)
    failed = [n for n, s in results.items() if s in ("failed", "error")]
    first = failed[0] if failed else None
    status = "timeout" if rc is None else ("failed" if failed else ("no tests" if not results else "passed"))
    message = messages.get(first, "") if first else ""
    return dict(name=mutant.name, area=mutant.area, path=mutant.path, what=mutant.what, tests=list(mutant.tests),
                tests_run=len(results), result=status, first_failure=first, message=message,
                margin=margin(message), seconds=round(seconds, 1))


_RATIO = (re.compile(r"relative error ([0-9.eE+-]+) > ([0-9.eE+-]+)"),      # helpers.assert_close
          re.compile(r"([0-9.eE+-]+)x (?:its|the) bound"))                  # entry-wise bounds


def margin(message: str) -> Optional[float]:
    """How far past its tolerance the failing check was (error / tolerance), when its message says."""
    m = _RATIO[0].search(message)
    if m:
        return round(float(m.group(1)) / float(m.group(2)), 3)
    m = _RATIO[1].search(message)
    return round(float(m.group(1)), 3) if m else None


def run(names: Optional[Sequence[str]] = None, *, seed: Optional[int] = None, jobs: int = 2, log=print,
        root: Path = ROOT, mutants: Sequence[Mutant] = MUTANTS) -> dict:
    """One run: every mutant of ``mutants`` (or those in ``names``) against a clean copy of ``root``'s tree,
    then the control; returns the run's record."""
    by_name = {m.name: m for m in mutants}
    chosen = tuple(mutants) if not names else tuple(by_name[n] for n in names)
    seed = int.from_bytes(os.urandom(4), "little") if seed is None else int(seed)
    files = tree_files(root)
    t0 = time.perf_counter()
    log(f"mutants: {len(chosen)} mutants, seed {seed} (RECLOSS_TEST_SEED), {jobs} job(s), {len(files)} files copied")
    with tempfile.TemporaryDirectory(prefix="recloss-mutants-") as tmp:
        tmp = Path(tmp)
        trees = []
        for j in range(max(1, jobs)):
            tree = tmp / f"tree{j}"
            copy_tree(root, tree, files)
            trees.append(tree)
        package = chosen[0].path.split("/")[0] if chosen else None
        if package and (trees[0] / package / "__init__.py").exists():
            where = subprocess.run([sys.executable, "-c", f"import {package}; print({package}.__file__)"],
                                   cwd=trees[0], env=_env(trees[0], seed), capture_output=True, text=True).stdout
            if not where.strip().startswith(str(trees[0])):
                raise RuntimeError(f"the copied tree's tests would import {package} from {where.strip()!r}, "
                                   "not the copy")
        for m in chosen:           # every mutant's text is found before anything runs
            apply(trees[0], m)
            (trees[0] / m.path).write_text((root / m.path).read_text())
        free = list(trees)
        results = {}
        with concurrent.futures.ThreadPoolExecutor(max_workers=len(trees)) as pool:
            pending = {}
            queue = list(chosen)
            while queue or pending:
                while queue and free:
                    m, tree = queue.pop(0), free.pop()
                    pending[pool.submit(run_mutant, tree, m, seed, tmp)] = (m, tree)
                done, _ = concurrent.futures.wait(pending, return_when=concurrent.futures.FIRST_COMPLETED)
                for fut in done:
                    m, tree = pending.pop(fut)
                    free.append(tree)
                    r = fut.result()
                    results[m.name] = r
                    log(f"  {m.name}: {r['result']} after {r['seconds']:.0f} s"
                        + (f" ({r['first_failure']}" if r["first_failure"] else "")
                        + (f"; {r['margin']:.3g}x its tolerance" if r["margin"] is not None else "")
                        + (f"; {r['message'][:160]}" if r["first_failure"] and r["margin"] is None else "")
                        + (")" if r["first_failure"] else ""))
        # The control: each first failing test, same seed, on the unmutated tree.
        nodes = sorted({r["first_failure"] for r in results.values()
                        if r["first_failure"] and r["first_failure"] != "<collection>"})
        control = {}
        if nodes:
            _, secs, control, _ = run_pytest(trees[0], nodes, seed, tmp / "control.xml", timeout=TIMEOUT_S * 2)
            log(f"  control: {len(nodes)} test(s) on the unmutated tree in {secs:.0f} s: "
                f"{sum(s == 'passed' for s in control.values())} passed")
    for r in results.values():
        first = r["first_failure"]
        clean = control.get(first) if first else None
        r["control"] = clean or ("n/a" if first is None or first == "<collection>" else "not run")
        if r["result"] == "failed" and (clean == "passed" or first == "<collection>"):
            r["status"] = "caught"
        elif r["result"] == "failed":
            r["status"] = "unproven"       # the same test does not pass on the clean tree
        else:
            r["status"] = "survived"
    seconds = time.perf_counter() - t0
    record = dict(date=datetime.date.today().isoformat(), commit=_commit(root), seed=seed, jobs=jobs,
                  seconds=round(seconds, 1), python=sys.version.split()[0], jax=_jax_version(),
                  mutants=[results[m.name] for m in chosen])
    caught = sum(r["status"] == "caught" for r in record["mutants"])
    log(f"mutants: {caught} of {len(chosen)} caught in {seconds:.0f} s (seed {seed})")
    return record


def _commit(root: Path) -> str:
    try:
        head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=root, capture_output=True, text=True,
                              check=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=root,
                               capture_output=True, text=True).stdout.strip()
        return head + ("+changes" if dirty else "")
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def _jax_version() -> str:
    try:
        from importlib.metadata import version
        return version("jax")
    except Exception:      # noqa: BLE001 - only for the record
        return "unknown"


# ----------------------------------------------------------------------------- the record
def append(record: dict, path: Path = RECORD) -> dict:
    """The record file with ``record`` added as its newest run (the last `KEEP_RUNS` kept)."""
    data = json.loads(path.read_text()) if path.exists() else {"runs": []}
    data["runs"] = (data["runs"] + [record])[-KEEP_RUNS:]
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data, indent=1) + "\n")
    return data


def format_table(data: dict) -> str:
    """The record as Markdown: one row per mutant of the newest run, with how many runs caught it."""
    runs = data["runs"]
    if not runs:
        raise ValueError("the record has no runs")
    last = runs[-1]
    by_run = [{r["name"]: r for r in run["mutants"]} for run in runs]
    when = ", ".join(f"{r['date']} seed {r['seed']}, {r['seconds'] / 60:.1f} min" for r in runs)
    lines = [f"{len(last['mutants'])} mutants; the last {len(runs)} runs ({when}):", "",
             "| mutant | area | the defect | caught | first failing test (last run; how far past its tolerance) | s |",
             "|---|---|---|---|---|---|"]
    for r in last["mutants"]:
        seen = [b[r["name"]] for b in by_run if r["name"] in b]
        caught = sum(x["status"] == "caught" for x in seen)
        test = (r["first_failure"] or "—").replace("tests/", "").replace("|", "\\|")
        past = "" if r.get("margin") is None else f" ({r['margin']:.3g}× its tolerance)"
        lines.append(f"| `{r['name']}` | {r['area']} | {r['what']} | {caught} of {len(seen)} | `{test}`{past} | "
                     f"{r['seconds']:.0f} |")
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tools.mutants", description=__doc__.split("\n\n")[0])
    parser.add_argument("--only", default="", help="comma-separated mutant names (default: all)")
    parser.add_argument("--seed", type=int, default=None, help="RECLOSS_TEST_SEED of the run (default: fresh)")
    parser.add_argument("--jobs", type=int, default=2, help="mutants run at once, each in its own copy (default 2)")
    parser.add_argument("--record", default=str(RECORD), help="the record to append the run to (default: %(default)s)")
    parser.add_argument("--no-record", action="store_true", help="print, do not append to the record")
    parser.add_argument("--list", action="store_true", help="list the mutants and exit")
    args = parser.parse_args(argv)
    if args.list:
        for m in MUTANTS:
            print(f"{m.name:45s} {m.area:9s} {m.path}: {m.what}")
        return 0
    names = [n for n in args.only.split(",") if n]
    unknown = sorted(set(names) - set(mutant_by_name()))
    if unknown:
        parser.error(f"unknown mutant(s) {unknown}; --list names them")
    record = run(names, seed=args.seed, jobs=args.jobs)
    if not args.no_record:
        data = append(record, Path(args.record))
        print(format_table(data))
    survivors = [r["name"] for r in record["mutants"] if r["status"] != "caught"]
    if survivors:
        print(f"not caught: {', '.join(survivors)}", file=sys.stderr)
    return 1 if survivors else 0


if __name__ == "__main__":
    sys.exit(main())
