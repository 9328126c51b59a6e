"""What recloss-bench times, per objective: its rows, their losses and nominal flops.

A `Row` is one configuration with a loss ``loss_of(hidden, table, targets) -> scalar``;
`cli.run_cpu` compiles and times every row the same way, whatever the objective.
An `Objective` names its entry point, its dense baseline (the 'vs dense' column),
the optax code users write for it, and which strategies recompute the logits
(8·BN·V·D nominal flops instead of 6). `format_cpu` and `format_topology` print
the tables, for recloss-bench and for the docs' rendered figures alike.

    bce       dense_bce, optax (sigmoid BCE), cutbce (+ recompute and matmuls-only rows)
    softmax   dense_ce, optax (softmax CE), cutce, cutce_pallas (--topology), tokamax (a peer)
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Callable, Dict, List, Optional, Sequence, Tuple

from recloss.bench import peers

MATMULS_ONLY = "cutbce blocked matmuls only (no loss math)"
OPTAX = "optax"   # a baseline, not a registered strategy
OPTAX_LABEL = "optax.sigmoid_binary_cross_entropy (dense, autodiff)"
OPTAX_SOFTMAX_LABEL = "optax.softmax_cross_entropy (dense, autodiff)"
TOKAMAX = peers.PREFIX   # 'tokamax' (every implementation there is) or 'tokamax:<implementation>'


@dataclasses.dataclass
class Row:
    """One benchmarked configuration: a strategy and how its loss is reduced."""
    label: str
    strategy: str
    flops_per_logit_dim: int      # nominal matmul flops = this × BN·V·D
    options: dict
    short: str                    # its name in the per-round progress line
    matmuls_only: bool = False    # the same blocked sweep with the loss math replaced by identity
    loss_of: Optional[Callable] = None   # (hidden, table, targets) -> scalar loss; table as `table_layout`
    table_layout: str = "VD"      # 'DV': the row takes the table as [D, V] (Tokamax's weights)
    peer: bool = False            # another library: its loss is reported against dense, not required to agree
    takes_block_v: bool = False   # a recloss blocked strategy (--block-v applies)
    fn: Optional[Callable] = None
    temp_bytes: int = 0
    compile_s: float = 0.0
    times: List[float] = dataclasses.field(default_factory=list)
    loss: Optional[float] = None


@dataclasses.dataclass(frozen=True)
class Objective:
    name: str
    entry_point: str              # the name in `recloss`
    dense: str                    # the baseline of the 'vs dense' columns
    cpu_strategies: Tuple[str, ...]
    topology_strategies: Tuple[str, ...]
    recompute: Tuple[str, ...]    # strategies whose loss+grad computes the logits twice (8·BN·V·D)
    optax_label: str
    flops_note: str


OBJECTIVES: Dict[str, Objective] = {
    "bce": Objective(
        "bce", "bce_loss", "dense_bce", ("dense_bce", OPTAX, "cutbce"),
        ("dense_bce", "cutbce", "cutbce_pallas"), (), OPTAX_LABEL,
        "Nominal flops: 6·BN·V·D for one fused pass or dense autodiff, 8·BN·V·D for forward + "
        "recompute; the matmuls-only row is the same blocked sweep with the loss math replaced "
        "by the identity (a ceiling, not a loss)."),
    "softmax": Objective(
        "softmax", "softmax_loss", "dense_ce", ("dense_ce", OPTAX, "cutce", TOKAMAX),
        ("dense_ce", "cutce", "cutce_pallas", TOKAMAX), ("cutce", "cutce_pallas"), OPTAX_SOFTMAX_LABEL,
        "Nominal flops: 6·BN·V·D for dense autodiff (dense_ce, optax), 8·BN·V·D where the logits are "
        "computed twice, in the forward and again in the backward (cutce, cutce_pallas, and Tokamax's "
        "xla and chunked_xla, whose custom VJPs recompute them)."),
}


def is_peer(name: str) -> bool:
    return name == TOKAMAX or name.startswith(TOKAMAX + ":")


def expand_peers(strategies: Sequence[str], labels: Optional[int], wanted=peers.CPU_IMPLEMENTATIONS):
    """``strategies`` with 'tokamax' replaced by 'tokamax:<impl>' for each implementation there is,
    and the notes of peers left out (why: not installed, L > 1, no such implementation)."""
    out, notes = [], []
    asked = [s for s in strategies if is_peer(s)]
    if not asked:
        return list(strategies), notes
    why = peers.import_error()
    if why is None and labels is not None and labels != 1:
        why = (f"Tokamax's linear_softmax_cross_entropy_loss takes one label per position (labels [B]); "
               f"this run has L={labels}: rerun with --labels 1")
    have = () if why else peers.implementations(peers.KNOWN)
    for s in strategies:
        if not is_peer(s):
            out.append(s)
            continue
        if why:
            notes.append(f"skipped {s}: {why}")
            continue
        impls = [i for i in wanted if i in have] if s == TOKAMAX else [s.split(":", 1)[1]]
        for impl in impls:
            if impl in have:
                out.append(f"{TOKAMAX}:{impl}")
            else:
                notes.append(f"skipped {TOKAMAX}:{impl}: Tokamax {peers.version()} has no {impl!r} "
                             f"implementation (it has {', '.join(have)})")
        if s == TOKAMAX and "chunked_xla" in wanted and "chunked_xla" not in have:
            notes.append(f"Tokamax {peers.version()} has no chunked_xla (its blocked implementation, "
                         "0.0.13+, Python >= 3.12): only its dense 'xla' runs here")
    return out, notes


def _identity_parts(x, *args, grad=True):
    """value = dvalue = logit: `recloss.bce.cut.sweep`'s per-logit math taken away."""
    return (x,), (x if grad else None)


@functools.lru_cache(maxsize=None)
def _matmuls_only_strategy():
    """The `cutbce` strategy class whose sweep takes `_identity_parts` (built once: its plans compare
    equal across calls)."""
    from recloss import sweep
    from recloss.bce import cut
    from recloss.bce.strategies import CutBCE

    class MatmulsOnly(CutBCE):
        cut_sweeps = sweep.Sweeps(*(functools.partial(cut.sweep, mode, parts=_identity_parts)
                                    for mode in sweep.Sweeps._fields))

    return MatmulsOnly


def matmuls_only_loss(h, e, t, **block):
    """`cutbce`'s blocked sweep with the loss math replaced by the identity: what is left is its three
    blocked matmuls and their bookkeeping, the ceiling of the fused pass on this machine (not a loss)."""
    import recloss

    return _matmuls_only_strategy()(recloss.LossOptions(**block))(h, e, t).loss


def rows_for(objective: Objective, strategies: Sequence[str]) -> List[Row]:
    """The rows of ``strategies`` (peers already expanded) for ``objective``."""
    import jax.numpy as jnp
    import recloss

    entry = getattr(recloss, objective.entry_point)

    def of(strategy, per_position=False, **opts):
        def loss(h, e, t, **block):      # block: block_v=... from --block-v
            out = entry(h, e, t, strategy=strategy, **opts, **block)
            # 'none' + mean: the same scalar as 'mean', but through the recompute VJP.
            return jnp.mean(out.loss) if per_position else out.loss
        return loss

    rows = []
    for name in strategies:
        if objective.name == "bce" and name == "cutbce":
            rows.append(Row("cutbce (fused)", name, 6, {}, "cutbce", loss_of=of(name), takes_block_v=True))
            rows.append(Row("cutbce (recompute, paper design)", name, 8, {"reduction": "none"}, "recompute",
                            loss_of=of(name, True, reduction="none"), takes_block_v=True))
            rows.append(Row(MATMULS_ONLY, name, 6, {}, "matmuls", matmuls_only=True,
                            loss_of=matmuls_only_loss, takes_block_v=True))
        elif name == OPTAX:
            fn = optax_bce_loss if objective.name == "bce" else optax_softmax_loss
            rows.append(Row(objective.optax_label, name, 6, {}, "optax", loss_of=fn))
        elif is_peer(name):
            impl = name.split(":", 1)[1]
            rows.append(Row(f"tokamax {impl}", name, 8, {}, impl, loss_of=tokamax_loss(impl),
                            table_layout="DV", peer=True))
        else:
            flops = 8 if name in objective.recompute else 6
            rows.append(Row(name, name, flops, {}, name, loss_of=of(name),
                            takes_block_v=name != objective.dense))
    return rows


def optax_bce_loss(hidden, table, targets):
    """What a user writes today: logits, a multi-hot matrix by scatter, optax's sigmoid BCE,
    mean over B·N·V (= recloss's defaults: reduction='mean', vocab_reduction='mean')."""
    import jax.numpy as jnp
    import optax

    d, v = hidden.shape[-1], table.shape[0]
    logits = hidden.reshape(-1, d) @ table.T
    ids = targets.reshape(logits.shape[0], -1)
    labels = jnp.zeros(logits.shape, logits.dtype).at[jnp.arange(ids.shape[0])[:, None], ids].set(1.0)
    return optax.sigmoid_binary_cross_entropy(logits, labels).mean()


def optax_softmax_loss(hidden, table, targets):
    """What a user writes today: logits, a multi-hot target distribution (each row's unique
    targets, normalised to sum 1), optax's softmax cross-entropy, mean over the positions with
    a target (= recloss.softmax_loss's defaults). Ids outside [0, V) (padding) are dropped."""
    import jax.numpy as jnp
    import optax

    d, v = hidden.shape[-1], table.shape[0]
    logits = hidden.reshape(-1, d) @ table.T
    ids = targets.reshape(logits.shape[0], -1)
    ids = jnp.where((ids >= 0) & (ids < v), ids, v)          # out of bounds: dropped by the scatter
    hot = jnp.zeros(logits.shape, logits.dtype).at[jnp.arange(ids.shape[0])[:, None], ids].set(
        1.0, mode="drop")
    k = jnp.sum(hot, axis=-1)
    ce = optax.softmax_cross_entropy(logits, hot / jnp.maximum(k, 1.0)[:, None])
    has = k > 0
    return jnp.sum(jnp.where(has, ce, 0.0)) / jnp.maximum(jnp.sum(has), 1)


def tokamax_loss(impl: str):
    """Tokamax's loss on [B·N] labels (L = 1) with its weights [D, V]."""
    fn = peers.loss_fn(impl)

    def loss(hidden, weights, targets):
        return fn(hidden.reshape(-1, hidden.shape[-1]), weights, targets.reshape(-1))
    return loss


def format_topology(topology: str, rows, objective: str = "bce", notes=()) -> str:
    """Markdown table of `topology.topology_rows` output (per-chip HBM, cost-analysis flops)."""
    gib = lambda x: f"{x / 2**30:.3f}" if isinstance(x, (int, float)) else str(x)
    lines = [
        f"per-chip HBM of loss+grad compiled for one chip of {topology} (XLA memory_analysis; "
        "HBM = arguments + outputs + temp)",
        "",
        "| strategy | B | N | D | V | HBM GiB | temp GiB | flops / 6·BN·V·D | compile s |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        flops = r["flops"]
        ratio = f"{flops / r['ideal_flops']:.3f}" if isinstance(flops, (int, float)) else (
            "-" if flops is None else str(flops))
        lines.append(f"| {r['strategy']} | {r['B']} | {r['N']} | {r['D']} | {r['V']:,} | {gib(r['hbm_bytes'])} | "
                     f"{gib(r['temp_bytes'])} | {ratio} | {r['compile_s']} |")
    lines.append("")
    if objective == "bce":
        lines.append("flops come from compiled.cost_analysis(): Pallas kernels report their pl.CostEstimate; "
                     "XLA counts a scan body once, so the cutbce (lax.scan) column understates its work.")
    else:
        lines.append("flops come from compiled.cost_analysis(): Pallas kernels report their pl.CostEstimate; "
                     "XLA counts a loop body once, so the cutce (lax.scan) and Tokamax chunked_xla (fori_loop) "
                     "columns understate their work (both compute 8·BN·V·D).")
        if any(is_peer(r["strategy"]) for r in rows):
            lines.append("Tokamax rows take one label per position (labels [B·N], its API) and the table as "
                         "[D, V]; the recloss rows L=8. The targets are B·N·L int32: a few KiB of HBM.")
    lines += list(notes)
    return "\n".join(lines)


def _seconds(x: float) -> str:
    """Seconds to three decimals, or four significant digits below 0.1 s (an accelerator's step)."""
    return f"{x:.3f}" if x >= 0.1 else f"{x:.4g}"


def format_cpu_total(info) -> str:
    """The closing line of a timing run: its wall time, where it ran (CPU cores, or the accelerator)
    and versions."""
    extra = f", libtpu {info['libtpu_version']}" if info.get("libtpu_version") else ""
    extra += f", tokamax {info['tokamax_version']}" if info.get("tokamax_version") else ""
    device = info.get("devices", "cpu")
    where = (f"{info['cpu_count']} CPU cores" if device.lower() == "cpu"
             else f"one {device} ({info['cpu_count']} host CPU cores)")
    return f"(total {info['total_s']}s on {where}, jax {info['jax_version']}{extra})"


def format_cpu(results, info, notes=()) -> str:
    """The CPU table and what follows from it (``notes``: rows left out, and why)."""
    objective = OBJECTIVES[info.get("objective", "bce")]
    lines = [
        f"loss+grad, float32, median of {results[0]['repeats']} interleaved runs (shuffled each round); "
        f"matmul ceiling {info['matmul_gflops_per_s']:.1f} GFLOP/s ({info['matmul_shape']}, ~1 s back to back "
        "in each round)",
        "",
        "| strategy | B×N | V | D | temp MiB | temp vs dense | median s | time vs dense | GFLOP/s (nominal) | of matmul |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in results:
        tvd = f"{r['temp_vs_dense']:.4f}" if r["temp_vs_dense"] is not None else "-"
        svd = f"{r['time_vs_dense']:.3f}" if r["time_vs_dense"] is not None else "-"
        lines.append(
            f"| {r['strategy']} | {r['batch']}×{r['seq']} | {r['vocab']:,} | {r['dim']} | {r['temp_mib']:.1f} | "
            f"{tvd} | {_seconds(r['median_s'])} | {svd} | {r['gflops_per_s']:.1f} | "
            f"{100 * r['matmul_fraction']:.0f}% |")
    if objective.name != "bce":
        lines.append("")
    fused = next((r for r in results if r["strategy"] == "cutbce (fused)"), None)
    recompute = next((r for r in results if r["strategy"].startswith("cutbce (recompute")), None)
    if fused and recompute:
        lines.append("")
        lines.append(f"fused / recompute time: {fused['median_s'] / recompute['median_s']:.3f} "
                     f"(flop ratio 6/8 = 0.750)")
    optax_row = next((r for r in results if r["strategy"] == OPTAX_LABEL), None)
    if fused and optax_row:
        lines.append(f"cutbce (fused) / optax dense time: {fused['median_s'] / optax_row['median_s']:.3f}, "
                     f"temp: {fused['temp_mib'] / optax_row['temp_mib']:.4f}")
    losses = [r["loss"] for r in results if r.get("loss") is not None and not r.get("peer")]
    if len(losses) > 1:
        spread = (max(losses) - min(losses)) / max(abs(min(losses)), 1e-30)
        verdict = "agree" if spread <= 1e-5 else "DISAGREE (a row computes a different loss!)"
        names = "" if objective.name == "bce" else " (" + ", ".join(
            r["strategy"] for r in results if r.get("loss") is not None and not r.get("peer")) + ")"
        lines.append(f"loss values of the rows{names} {verdict}: {min(losses):.7g} .. {max(losses):.7g} "
                     f"(relative spread {spread:.1e})")
    mm = next((r for r in results if r["strategy"] == MATMULS_ONLY), None)
    if fused and mm:
        logits = fused["batch"] * fused["seq"] * fused["vocab"]
        extra = fused["median_s"] - mm["median_s"]
        lines.append(
            f"fused / blocked matmuls alone: {fused['median_s'] / mm['median_s']:.3f}. The difference, "
            f"{_seconds(extra)} s, is the loss math: per logit exp(−|x|), log1p, exp(−x), one divide and ~8 "
            f"cheap ops, {logits / 1e6:.1f} M logits, {1e9 * extra / logits:.3g} ns per logit.")
    if objective.name == "softmax":
        lines += _softmax_lines(results, info)
    lines += list(notes)
    lines.append(objective.flops_note)
    return "\n".join(lines)


def _softmax_lines(results, info) -> list:
    """The peers' losses against the dense one, and cutce against each peer and the ceiling."""
    lines = []
    dense = next((r for r in results if r["strategy"] == info.get("dense")), None)
    cut = next((r for r in results if r["strategy"] == "cutce"), None)
    pad = info.get("chunked_xla_padding")
    for r in results:
        if not r.get("peer"):
            continue
        if dense and dense.get("loss"):
            rel = (r["loss"] - dense["loss"]) / abs(dense["loss"])
            line = f"{r['strategy']} loss vs {dense['strategy']}: {r['loss']:.7g} ({rel:+.2e} relative)"
            if r["strategy"] == "tokamax chunked_xla" and pad:
                line += (f"; V = {r['vocab']:,} is not a multiple of its v_block_size {pad['v_block']}: the "
                         f"{pad['pad_columns']} zero columns it pads the table with count exp(0) each in "
                         f"its log-partition, which predicts {pad['predicted_relative']:+.2e} (not a "
                         "precision effect)")
            lines.append(line)
        if cut:
            lines.append(f"cutce / {r['strategy']}: time {cut['median_s'] / r['median_s']:.3f}, "
                         f"temp {cut['temp_mib'] / max(r['temp_mib'], 1e-9):.4f}")
    if cut:
        lines.append(f"cutce at 8·BN·V·D: {cut['gflops_per_s']:.1f} GFLOP/s, "
                     f"{100 * cut['matmul_fraction']:.0f}% of the same-run matmul ceiling "
                     f"({info['matmul_gflops_per_s']:.1f} GFLOP/s)")
    if info.get("precision", "default") != "default":
        lines.append(f"every row and the ceiling traced under jax.default_matmul_precision({info['precision']!r})")
    return lines
