"""Block sizes and VMEM budgets for the Mosaic-TPU kernels (BCE: `recloss.bce.kernel`, softmax:
`recloss.softmax.kernel`, both on the grid of `recloss.pallas.grid`).

One kernel call keeps a row tile resident in VMEM and walks vocabulary blocks:

    resident per call:  A [bn, Dp] (input dtype), dA [bn, Dp] f32 (gradient
                        modes), and the per-row vectors as [bn, 128] f32 lanes
                        (BCE: r, bg, counts; softmax: r, lse or max, sum-exp, argmax)
    per vocab step:     E_j [bv, Dp], b_j [1, bv], dE_j [bv, Dp], db_j [1, bv]
    temporaries:        ~K logit-shaped [bs, bv] f32 arrays for the inner row
                        sub-tile loop (x, softplus, sigmoid, value, G, ...)

Every pipelined block is double-buffered (×2). Rows that do not fit become an
outer loop of row chunks (``num_chunks`` > 1), with dE accumulated across
chunks in HBM. Sizes follow the (8, 128) tiling rule: bv is a multiple of 128
(it is the lane dimension of the bias/db blocks), bn a multiple of 8 rows (16
for 16-bit hidden states, which pack two rows per sublane).

Modes (`MODES`, keyed by (objective, sweep mode)): ('bce', 'fused'), ('bce', 'loss'),
('bce', 'grad') and ('softmax', 'loss'), ('softmax', 'grad').
"""

from __future__ import annotations

import dataclasses
import math
from typing import Callable, NamedTuple, Optional

from recloss.options import LossOptions

MiB = 1 << 20
LANES = 128

# Fraction of a TensorCore's VMEM given to the kernel as its vmem_limit_bytes,
# and the fraction of that limit our own estimate may fill (Mosaic needs some
# internal scratch, and our temporaries count is an estimate).
_LIMIT_FRACTION = 0.75
_BUDGET_FRACTION = 0.8
# Share of the budget the [bs, bv] temporaries may take when sizes are automatic.
_TEMP_SHARE = 1 / 3
_BV_TARGET = 1024
_BS_TARGET = 512


@dataclasses.dataclass(frozen=True)
class Mode:
    """What the VMEM estimate needs to know about one kernel mode."""
    grad: bool           # dA resident, dE_j/db_j written per block
    row_vectors: int     # per-row vectors resident as [bn, 128] f32 lanes
    temps: int           # logit-shaped [bs, bv] f32 temporaries alive at once


# Keyed by (objective, sweep mode).
MODES = {
    # BCE (recloss.bce.kernel): bg, counts (loss modes); r (gradient modes).
    ("bce", "fused"): Mode(True, 3, 10),
    ("bce", "loss"): Mode(False, 2, 6),
    ("bce", "grad"): Mode(True, 1, 9),
    # Softmax (recloss.softmax.kernel): running max, sum-exp, argmax; r and lse for the recompute.
    # Temporaries: x, x/τ masked, exp (loss); x, x/τ, exp(x − lse), G, G cast (grad).
    ("softmax", "loss"): Mode(False, 3, 4),
    ("softmax", "grad"): Mode(True, 2, 6),
}


@dataclasses.dataclass(frozen=True)
class Chip:
    """What the tiling needs to know about one TPU chip generation (per TensorCore)."""
    name: str
    vmem_bytes: int          # VMEM per TensorCore
    cores: int               # TensorCores one JAX device drives (split by the kernel)
    mxu: int                 # MXU edge (128 or 256)
    core_semantics: str = "parallel"   # grid semantics that spreads the core axis

    @property
    def vmem_limit_bytes(self) -> int:
        return int(self.vmem_bytes * _LIMIT_FRACTION)

    @property
    def budget_bytes(self) -> int:
        return int(self.vmem_limit_bytes * _BUDGET_FRACTION)


# Numbers as in jax's pallas tpu_info tables (VMEM per TensorCore). v4 and v5p
# run their two TensorCores as one "megacore" device ('parallel' splits it);
# v7 exposes both cores of a chip to one device without megacore, so the core
# axis needs 'core_parallel'.
CHIPS = {
    "v4": Chip("v4", 16 * MiB, 2, 128),
    "v5e": Chip("v5e", 128 * MiB, 1, 128),
    "v5p": Chip("v5p", 64 * MiB, 2, 128),
    "v6e": Chip("v6e", 128 * MiB, 1, 256),
    "v7": Chip("v7", 64 * MiB, 2, 256, core_semantics="core_parallel"),
}
# Used when the chip cannot be identified (e.g. interpret mode on CPU): the
# smallest VMEM of the current generations, one core.
GENERIC = Chip("generic", 64 * MiB, 1, 128)

_DEVICE_KINDS = {
    "tpu v4": "v4",
    "tpu v5 lite": "v5e", "tpu v5e": "v5e", "tpu v5litepod": "v5e",
    "tpu v5": "v5p", "tpu v5p": "v5p",
    "tpu v6 lite": "v6e", "tpu v6e": "v6e",
    "tpu7": "v7", "tpu7x": "v7", "tpu v7": "v7", "tpu v7x": "v7",
}


def chip_from_device_kind(device_kind: str, num_cores: Optional[int] = None) -> Chip:
    """The `Chip` for a device_kind string such as 'TPU v6 lite'; GENERIC if unknown.

    ``num_cores`` (the device's TensorCore count, when known) overrides the
    table: a two-core chip used in split mode reports 1 and must not be split.
    """
    key = _DEVICE_KINDS.get(str(device_kind).strip().lower())
    chip = CHIPS[key] if key else GENERIC
    if num_cores is not None and num_cores >= 1 and num_cores != chip.cores:
        chip = dataclasses.replace(chip, cores=int(num_cores))
    return chip


def get_chip(name: Optional[str] = None) -> Chip:
    """The chip to tile for.

    ``name`` ('v5e', 'v5p', 'v6e', ...) forces a table entry (tests, AOT).
    Otherwise: the abstract mesh's device when tracing under ``jax.set_mesh``
    (TPU topologies for ahead-of-time compilation), else the default device;
    on a real TPU `pltpu.get_tpu_info()` supplies VMEM and core count.
    """
    if name is not None:
        if name not in CHIPS:
            raise ValueError(f"unknown TPU chip {name!r}: expected one of {sorted(CHIPS)}")
        return CHIPS[name]
    import jax
    from jax.sharding import get_abstract_mesh

    abstract = getattr(get_abstract_mesh(), "abstract_device", None)
    if abstract is not None and abstract.platform == "tpu":
        return chip_from_device_kind(abstract.device_kind, abstract.num_cores)
    device = jax.devices()[0]
    if device.platform != "tpu":
        return GENERIC
    chip = chip_from_device_kind(device.device_kind, getattr(device, "num_cores", None))
    try:
        from jax.experimental.pallas import tpu as pltpu
        info = pltpu.get_tpu_info()
    except Exception:  # an unknown device kind: keep the table's numbers
        return chip
    return dataclasses.replace(chip, vmem_bytes=int(info.vmem_capacity_bytes),
                               cores=int(info.num_cores), mxu=int(info.mxu_column_size))


@dataclasses.dataclass(frozen=True)
class Tiling:
    """Static block configuration of one kernel sweep.

    bn: rows resident per call (multiple of bs); bs: rows per inner sub-tile;
    bv: vocabulary block; num_chunks: calls over rows (bn·num_chunks ≥ M);
    cores: leading 'parallel' grid axis splitting the vocab blocks;
    d_pad: D rounded up to 128; vmem_bytes: our estimate for these sizes.
    """
    bn: int
    bs: int
    bv: int
    num_chunks: int
    cores: int
    d_pad: int
    vmem_bytes: int
    chip: Chip
    resident_buffers: int = 2   # 1: the resident blocks single-buffered (`pl.Buffered(1)`), see `choose`

    @property
    def rows(self) -> int:
        return self.bn * self.num_chunks


def _round_up(x: int, m: int) -> int:
    return -(-x // m) * m


def kernel_dtype(dtype):
    """The dtype an operand of ``dtype`` has inside the kernels: float16 is widened to float32 (exact)
    before the call, every other dtype is kept. Mosaic has no float16 vector loads: a float16 block
    fails to compile ("Invalid vector type for load") for v5e, v5p and v6e alike."""
    import numpy as np
    return np.dtype(np.float32) if np.dtype(dtype) == np.float16 else np.dtype(dtype)


def sublanes(dtype) -> int:
    """Row multiple of the (8, 128) rule for a hidden-state dtype: 8 for 32-bit, 16 for 16-bit."""
    import numpy as np
    return 8 * max(1, 4 // np.dtype(dtype).itemsize)


def vmem_estimate(mode: tuple, bn: int, bs: int, bv: int, d_pad: int, a_bytes: int, e_bytes: int, *,
                  bias: bool, accumulate: bool, resident_buffers: int = 2, temps: Optional[int] = None) -> int:
    """VMEM bytes one kernel call needs (per TensorCore), the vocab blocks double-buffered and the
    resident ones (row tile, per-row vectors, dA) ``resident_buffers`` times; ``temps`` [bs, bv] f32
    temporaries (None: the mode's `MODES` count)."""
    spec = MODES[mode]
    grad, row_vectors = spec.grad, spec.row_vectors
    temps = spec.temps if temps is None else temps
    per_row = d_pad * (a_bytes + (4 if grad else 0)) + LANES * 4 * row_vectors
    de_bytes = 4 if grad else 0
    per_col = d_pad * (e_bytes + de_bytes + (4 if accumulate else 0))
    per_col += 8 * 4 * ((1 if bias else 0) + (1 if grad and bias else 0))   # [1, bv] pads to 8 sublanes
    scratch = bv * d_pad * 4 if grad and e_bytes < 4 else 0   # f32 dE accumulator for 16-bit tables
    return resident_buffers * bn * per_row + 2 * bv * per_col + scratch + temps * bs * bv * 4


def _inner_rows(bn: int, sub: int) -> int:
    """Largest multiple of ``sub`` that divides bn and is ≤ the sub-tile target."""
    best = sub
    for k in range(sub, min(bn, _BS_TARGET) + 1, sub):
        if bn % k == 0:
            best = k
    return best


class _Problem(NamedTuple):
    """What `choose` sizes blocks for: padded sizes, the VMEM estimate of a candidate tiling, and the
    words its errors use."""
    m: int
    m_pad: int
    v_local: int
    v_pad: int
    d: int
    d_pad: int
    sub: int              # row granularity of the hidden dtype
    temps: int            # logit-shaped temporaries of the mode
    budget: int
    who: str              # the strategy (or kernel sweep) named in errors
    where: str            # the budget, in words
    estimate: Callable    # estimate(bn, bs, bv, chunks) -> VMEM bytes
    narrow_de: bool       # a gradient mode with a 16-bit table: row chunks would cost an f32 [V, D] in HBM


def choose(mode: tuple, m: int, v_local: int, d: int, a_dtype, e_dtype, opts: LossOptions, *,
           bias: bool, chip: Chip, who: str = "", temps: Optional[int] = None) -> Tiling:
    """Block sizes for ``mode`` on ``chip``: a key of `MODES`, (objective, sweep mode), e.g.
    ('bce', 'fused') for BCE's loss and gradients in one sweep or ('softmax', 'grad'). ``who``
    (the strategy's name) is named in errors; ``temps``: the [bs, bv] f32 temporaries of the kernel's
    tile (its per-logit term declares them; None: `MODES`'s count).

    Explicit ``opts.block_n`` / ``opts.block_v`` are used as given (clamped to
    the problem size) and must obey the tiling rule and fit the VMEM budget:
    anything else is a ValueError naming the value, the rule and the budget. Otherwise the sub-tile
    and vocab block are the chip's measured ones (`recloss.pallas.tuned`) where it has an entry for
    the mode, dtype and D, else the heuristic targets, shrunk to fit the budget either way.
    """
    import numpy as np
    if mode not in MODES:
        raise ValueError(f"mode must be one of {tuple(MODES)}, got {mode!r}")
    spec = MODES[mode]
    who = who or f"the {mode[0]} kernel's {mode[1]!r} sweep"
    a_dtype, e_dtype = kernel_dtype(a_dtype), kernel_dtype(e_dtype)
    a_bytes, e_bytes = np.dtype(a_dtype).itemsize, np.dtype(e_dtype).itemsize
    sub = sublanes(a_dtype)
    d_pad = _round_up(d, LANES)
    budget = chip.budget_bytes
    where = (f"the VMEM budget of {budget / MiB:.1f} MiB per TensorCore on chip {chip.name!r} "
             f"({_BUDGET_FRACTION:.0%} of vmem_limit_bytes={chip.vmem_limit_bytes / MiB:.1f} MiB)")
    if opts.block_v is not None and opts.block_v % LANES:
        raise ValueError(f"LossOptions.block_v={opts.block_v} is invalid for {who}: the TPU "
                         f"(8, 128) tiling rule needs a multiple of {LANES} (it is the lane dimension "
                         f"of the bias and db blocks); {where}")
    if opts.block_n is not None and opts.block_n % sub:
        raise ValueError(f"LossOptions.block_n={opts.block_n} is invalid for {who} with "
                         f"{np.dtype(a_dtype).name} hidden states: the TPU (8, 128) tiling rule needs "
                         f"a multiple of {sub} rows; {where}")

    temps = spec.temps if temps is None else int(temps)

    def estimate(bn, bs, bv, chunks, resident_buffers=2):
        return vmem_estimate(mode, bn, bs, bv, d_pad, a_bytes, e_bytes, bias=bias,
                             accumulate=chunks > 1 and spec.grad, resident_buffers=resident_buffers, temps=temps)

    p = _Problem(m, _round_up(max(m, 1), sub), v_local, _round_up(v_local, LANES), d, d_pad, sub, temps,
                 budget, who, where, estimate, spec.grad and e_bytes < 4)
    if opts.block_n is not None:
        return _explicit_rows(p, opts, chip)
    from recloss.pallas import tuned
    return _automatic_rows(p, opts, chip, tuned.blocks(chip.name, mode, np.dtype(e_dtype).name, d))


def _explicit_rows(p: _Problem, opts: LossOptions, chip: Chip) -> Tiling:
    """``opts.block_n`` rows per call as given (bv halved to fit unless ``opts.block_v`` is set)."""
    bv = min(opts.block_v or _BV_TARGET, p.v_pad)
    bn = min(opts.block_n, p.m_pad)
    bs = _inner_rows(bn, p.sub)
    chunks = math.ceil(p.m / bn) if p.m else 1
    need = p.estimate(bn, bs, bv, chunks)
    while need > p.budget and opts.block_v is None and bv > LANES:
        bv = _halve(bv)
        need = p.estimate(bn, bs, bv, chunks)
    if need > p.budget:
        raise ValueError(
            f"LossOptions.block_n={opts.block_n}, block_v={opts.block_v} need about "
            f"{need / MiB:.1f} MiB of VMEM for {p.who} (D={p.d}), over {p.where}; "
            f"choose smaller blocks or leave them None to size them automatically")
    return Tiling(bn, bs, bv, chunks, _cores(chip, p.v_local, bv), p.d_pad, need, chip)


def _automatic_rows(p: _Problem, opts: LossOptions, chip: Chip, measured=None) -> Tiling:
    """Sub-tiles and blocks within the temporaries' share of the budget (``measured`` (bs, bv), the
    chip's tuned entry, as they are), then all rows in one resident tile when they fit (no dE
    accumulation in HBM), else the fewest row chunks that fit."""
    bs_target, bv_target = measured or (_BS_TARGET, _BV_TARGET)
    bv = min(opts.block_v or bv_target, p.v_pad)
    bs = min(bs_target, p.m_pad)
    temps = lambda bs_, bv_: p.temps * bs_ * bv_ * 4
    share = 1.0 if measured else _TEMP_SHARE      # a measured entry ran at its sizes on the chip
    while temps(bs, bv) > p.budget * share and opts.block_v is None and bv > 2 * LANES:
        bv = _halve(bv)
    while temps(bs, bv) > p.budget * share and bs > 128:
        bs = max(128, _round_up(bs // 2, p.sub))
    est = p.estimate
    # Wide hidden states (D in the thousands: LLM decoders) make the blocks' [bv, D] and [bs, D] buffers,
    # not the logit temporaries, what overflows: halve the larger of the vocab block and the row tile,
    # down to 256 each, then to the 128 floor.
    for floor in (2 * LANES, LANES):
        while est(bs, bs, bv, 2) > p.budget:
            can_v, can_s = opts.block_v is None and bv > floor, bs > max(floor, p.sub)
            if can_v and (bv >= bs or not can_s):
                bv = _halve(bv)
            elif can_s:
                bs = max(floor, _round_up(bs // 2, p.sub))
            else:
                break
    if est(bs, bs, bv, 2) > p.budget:
        what = f"LossOptions.block_v={bv}" if opts.block_v else f"block_v={bv}"
        raise ValueError(
            f"{p.who} cannot tile D={p.d} with {what} and {bs}-row tiles within {p.where}; "
            f"the smallest such configuration needs {est(bs, bs, bv, 2) / MiB:.1f} MiB")
    one = _round_up(p.m_pad, bs)
    if est(one, bs, bv, 1) <= p.budget:
        return Tiling(one, bs, bv, 1, _cores(chip, p.v_local, bv), p.d_pad, est(one, bs, bv, 1), chip)
    if p.narrow_de and opts.block_v is None:
        # Row chunks would accumulate a 16-bit table's dE across chunks in an f32 [V, D] HBM buffer (594 MiB
        # at an LLM head). One resident tile, single-buffered (its index never changes), with vocab blocks
        # halved down to 256, is cheaper when it fits: dE_j is then complete in VMEM before its one rounding.
        narrow = bv
        while est(one, bs, narrow, 1, 1) > p.budget and narrow > 2 * LANES:
            narrow = _halve(narrow)
        if est(one, bs, narrow, 1, 1) <= p.budget:
            return Tiling(one, bs, narrow, 1, _cores(chip, p.v_local, narrow), p.d_pad,
                          est(one, bs, narrow, 1, 1), chip, resident_buffers=1)
    per_row = (est(2 * bs, bs, bv, 2) - est(bs, bs, bv, 2)) / bs
    max_bn = bs * max(1, int((p.budget - est(bs, bs, bv, 2)) / per_row / bs) + 1)
    chunks = math.ceil(p.m_pad / max_bn)
    bn = _round_up(math.ceil(p.m_pad / chunks), bs)
    return Tiling(bn, bs, bv, chunks, _cores(chip, p.v_local, bv), p.d_pad, est(bn, bs, bv, chunks), chip)


def _halve(bv: int) -> int:
    """About half of bv, still a multiple of 128 (and at least 128)."""
    return max(LANES, (bv // 2) // LANES * LANES)


def _cores(chip: Chip, v_local: int, bv: int) -> int:
    """Cores to split the vocab blocks over: the chip's, but never more than blocks."""
    return max(1, min(chip.cores, math.ceil(v_local / bv)))
