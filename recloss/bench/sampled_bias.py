"""`recloss-bench --sampled-bias`: how far sampled_softmax's gradient is from the exact softmax's, by K.

The state is one a recommender reaches: a Zipf(1) item popularity in the output bias and targets
drawn from the model's own softmax (so the exact loss is near its minimum, where a biased gradient
does its harm). Rows: `recloss.sampled_bias` for K in ``--ks``, negatives drawn uniformly or from
the popularity counts (with the logQ correction), with accidental hits kept (the default) or removed.

    recloss-bench --sampled-bias --json docs/figures/sampled-bias.json --plot docs/sampled-bias.png

On your own model: ``recloss.sampled_bias(hidden, table, targets, weights, bias, key=...,
proposals={"uniform": None, "counts": recloss.log_q_from_counts(counts)})``.
"""

from __future__ import annotations

import time
from typing import Dict, List, Optional

import numpy as np

SHAPE = dict(vocab=1682, dim=32, rows=256, labels=8)       # a 1,682-item catalogue, as the real log
QUICK = dict(vocab=211, dim=16, rows=64, labels=4)
KS = (16, 64, 128, 256, 1024, 4096)
QUICK_KS = (8, 64, 1024)
VARIANTS = (("uniform", False), ("uniform", True), ("counts", False), ("counts", True))   # (proposal, hits removed)


def skewed_state(*, vocab: int, dim: int, rows: int, labels: int, seed: int = 0) -> Dict[str, np.ndarray]:
    """hidden [rows, dim], table [vocab, dim], bias [vocab] (log popularity, centred), targets
    [rows, labels] drawn from the model's own softmax, counts [vocab] (the Zipf popularity, scaled)."""
    rng = np.random.default_rng(seed)
    pop = 1.0 / np.arange(1, vocab + 1)
    rng.shuffle(pop)
    q = pop / pop.sum()
    hidden = rng.normal(size=(rows, dim)).astype(np.float32)
    table = (rng.normal(size=(vocab, dim)) / np.sqrt(dim)).astype(np.float32)
    bias = np.log(q).astype(np.float32)
    bias -= bias.mean()
    logits = hidden.astype(np.float64) @ table.T + bias
    p = np.exp(logits - logits.max(1, keepdims=True))
    p /= p.sum(1, keepdims=True)
    targets = np.stack([rng.choice(vocab, labels, p=pi) for pi in p]).astype(np.int32)
    return dict(hidden=hidden, table=table, bias=bias, targets=targets, counts=q * 1e6)


def run(*, quick: bool = False, ks=None, draws: int = 32, seed: int = 0, log=print) -> dict:
    """The rows of every variant and K, and what ran ('info')."""
    import jax

    import recloss

    shape = dict(QUICK if quick else SHAPE)
    ks = tuple(QUICK_KS if quick else KS) if ks is None else tuple(ks)
    st = skewed_state(**shape, seed=seed)
    log_q = np.asarray(recloss.log_q_from_counts(st["counts"]))
    t0 = time.perf_counter()
    rows: List[dict] = []
    for proposal, removed in VARIANTS:
        out = recloss.sampled_bias(st["hidden"], st["table"], st["targets"], None, st["bias"],
                                   key=jax.random.key(seed), num_negatives=ks, draws=draws,
                                   proposals={proposal: None if proposal == "uniform" else log_q},
                                   remove_accidental_hits=removed,
                                   log=lambda line, r=removed: log(f"[bias] hits {'removed' if r else 'kept':>7} {line}"))
        rows += [dict(r, hits_removed=removed) for r in out]
    info = dict(shape, ks=list(ks), draws=draws, seed=seed, total_s=round(time.perf_counter() - t0, 1),
                jax_version=jax.__version__, state="Zipf(1) popularity bias, targets from the model's softmax")
    return {"info": info, "rows": rows}


def format_table(payload: dict) -> str:
    """Markdown: cosine of the mean gradient (dE, dA) and one draw's dE cosine, per variant and K."""
    info, rows = payload["info"], payload["rows"]
    lines = [f"| negatives | accidental hits | K | cos dE | cos dA | one draw: cos dE | loss gap |",
             "|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['proposal']} | {'removed' if r['hits_removed'] else 'kept'} | {r['num_negatives']:,} | "
                     f"{r['cos_dE']:.3f} | {r['cos_dA']:.3f} | {r['cos_draw_dE']:.3f} | {r['loss_gap']:+.3f} |")
    lines += ["", f"V = {info['vocab']:,}, D = {info['dim']}, {info['rows']} positions x {info['labels']} targets "
              f"({info['state']}); {info['draws']} draws per row, seed {info['seed']}; {info['total_s']} s."]
    return "\n".join(lines)


def render(payload: dict, path: Optional[str] = None):
    """cos dE of the mean sampled gradient against K, one line per variant; saved to ``path`` (PNG)."""
    from recloss.bench.plot import _pyplot

    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    style = {("uniform", False): ("tab:blue", "-"), ("uniform", True): ("tab:blue", ":"),
             ("counts", False): ("tab:green", "-"), ("counts", True): ("tab:green", ":")}
    for (proposal, removed), (colour, ls) in style.items():
        pts = [(r["num_negatives"], r["cos_dE"]) for r in payload["rows"]
               if r["proposal"] == proposal and r["hits_removed"] == removed]
        if pts:
            ax.plot(*zip(*pts), color=colour, linestyle=ls, marker="o",
                    label=f"{proposal}{' (logQ)' if proposal == 'counts' else ''}, hits {'removed' if removed else 'kept'}")
    info = payload["info"]
    ax.axvline(info["vocab"], color="grey", linewidth=0.8)
    ax.text(info["vocab"], 0.3, " K = V", color="grey", transform=ax.get_xaxis_transform())
    ax.set_xscale("log")
    ax.set_ylim(0, 1.02)
    ax.set_xlabel("K (negatives per step)")
    ax.set_ylabel("cos(E[sampled dE], exact softmax dE)")
    ax.set_title(f"sampled_softmax vs the exact gradient, V = {info['vocab']:,}", fontsize=10)
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8, loc="lower right")
    fig.tight_layout()
    if path:
        fig.savefig(path, dpi=150)
    return fig
