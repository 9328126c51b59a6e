"""`recloss-bench --plot PATH`: the benchmark as one figure.

Left: per-chip HBM of loss+grad (arguments + outputs + temp, XLA's memory_analysis) against V,
compiled ahead of time for one chip of a v6e (`recloss.bench.topology`, libtpu, no TPU needed),
for the dense and blocked strategies of each objective; a compile that runs out of HBM is an ×
on the chip's HBM line. Right: CPU seconds per loss+grad step against V, the median of
interleaved runs (`cli.run_cpu`: all rows of one V back to back, shuffled each round).

    payload = cli.plot_payload()   # minutes: ~30 TPU compiles, then the CPU runs
    render(payload, "docs/bench.png")

matplotlib is the optional ``plot`` extra (``pip install 'recloss[plot]'``).
"""

from __future__ import annotations

from typing import Optional

TOPOLOGY = "v6e-8"
HBM_GIB = {"v6e-8": 32, "v5e-8": 16, "v5p-8": 95, "v4-8": 32}      # per chip
# Dense and blocked strategies of each objective, in the figure's order.
TOPOLOGY_STRATEGIES = ("dense_bce", "cutbce", "cutbce_pallas", "dense_ce", "cutce", "cutce_pallas")
CPU_STRATEGIES = {"bce": ("dense_bce", "cutbce"), "softmax": ("dense_ce", "cutce")}
# Per chip: the paper's Table III loss (B=8 of a v6e-8 at global batch 64, N=256, D=256, L=8).
TOPOLOGY_SHAPE = dict(B=8, N=256, D=256, L=8)
TOPOLOGY_VOCABS = (100_000, 300_000, 1_000_000, 3_000_000, 10_000_000)
# The CPU runs are smaller (this machine's memory and time): the dense rows' [BN, V] logits.
CPU_SHAPE = dict(batch=2, seq=128, dim=64, labels=8)
CPU_VOCABS = (100_000, 300_000, 1_000_000)
QUICK = dict(topology_vocabs=(100_000, 10_000_000), cpu_vocabs=(20_000, 100_000),
             topology_shape=dict(B=2, N=128, D=128, L=8), cpu_shape=dict(batch=2, seq=32, dim=32, labels=4))

STYLE = {  # strategy -> (colour, line style, marker)
    "dense_bce": ("tab:red", "-", "o"), "cutbce": ("tab:blue", "-", "s"), "cutbce_pallas": ("tab:cyan", "-", "^"),
    "dense_ce": ("tab:orange", "--", "o"), "cutce": ("tab:green", "--", "s"),
    "cutce_pallas": ("tab:olive", "--", "^"),
}


def _pyplot():
    try:
        import matplotlib
    except ImportError as err:
        raise RuntimeError("recloss-bench --plot needs matplotlib: pip install 'recloss[plot]'") from err
    matplotlib.use("Agg")     # files only; no display needed
    import matplotlib.pyplot as plt
    return plt


def render(payload: dict, path: Optional[str] = None):
    """Draws `cli.plot_payload`'s payload (two panels, log-log) and saves it to ``path`` (PNG at 150 dpi);
    returns the matplotlib Figure."""
    plt = _pyplot()
    info = payload["info"]
    topology = info["topology"]
    hbm_limit = HBM_GIB.get(topology)
    fig, (ax_hbm, ax_cpu) = plt.subplots(1, 2, figsize=(13, 5.2))

    strategies = list(dict.fromkeys(r["strategy"] for r in payload["topology"]))
    for name in strategies:
        colour, ls, marker = STYLE.get(name, (None, "-", "o"))
        pts = sorted((r["V"], r["hbm_bytes"]) for r in payload["topology"] if r["strategy"] == name)
        ok = [(v, b / 2**30) for v, b in pts if isinstance(b, (int, float))]
        oom = [v for v, b in pts if b == "OOM"]
        line, = ax_hbm.plot([v for v, _ in ok], [g for _, g in ok], ls=ls, marker=marker, color=colour,
                            label=name)
        if oom:
            y = hbm_limit if hbm_limit else max((g for _, g in ok), default=1.0)
            ax_hbm.scatter(oom, [y] * len(oom), marker="x", s=90, linewidths=2.5, color=line.get_color(),
                           zorder=5)
    if hbm_limit:
        ax_hbm.axhline(hbm_limit, color="grey", lw=1, ls=":")
        ax_hbm.text(min(r["V"] for r in payload["topology"]), hbm_limit * 1.12,
                    f"{topology} HBM per chip ({hbm_limit} GiB); × = out of HBM (does not compile)",
                    fontsize=8, color="dimgrey")
    s = info["topology_shape"]
    ax_hbm.set(xscale="log", yscale="log", xlabel="catalogue size V", ylabel="HBM per chip, GiB",
               title=f"loss+grad on one {topology} chip (AOT compile)\nB={s['B']} N={s['N']} D={s['D']} "
                     f"L={s['L']} float32")
    ax_hbm.grid(True, which="both", alpha=0.3)
    ax_hbm.legend(fontsize=8, loc="lower right")

    for objective in dict.fromkeys(r["objective"] for r in payload["cpu"]):
        for name in dict.fromkeys(r["strategy"] for r in payload["cpu"] if r["objective"] == objective):
            colour, ls, marker = STYLE.get(name, (None, "-", "o"))
            pts = sorted((r["vocab"], r["median_s"]) for r in payload["cpu"]
                         if r["objective"] == objective and r["strategy"] == name)
            ax_cpu.plot([v for v, _ in pts], [t for _, t in pts], ls=ls, marker=marker, color=colour, label=name)
    c = info["cpu_shape"]
    cores = f" on {info['cpu_count']} CPU cores" if info.get("cpu_count") else ""
    ax_cpu.set(xscale="log", yscale="log", xlabel="catalogue size V", ylabel="seconds per loss+grad step",
               title=f"CPU time per step{cores} (median of {info['repeats']} interleaved runs)\n"
                     f"B={c['batch']} N={c['seq']} D={c['dim']} L={c['labels']} float32")
    ax_cpu.grid(True, which="both", alpha=0.3)
    if payload["cpu"]:
        ax_cpu.legend(fontsize=8, loc="lower right")
    fig.suptitle(f"recloss-bench --plot  (recloss {info.get('recloss_version', '?')}, jax {info['jax_version']})",
                 fontsize=10)
    fig.tight_layout()
    if path:
        fig.savefig(path, dpi=150)
    return fig
