"""The cost table of docs/sharding.md rendered from a `tools.cost_figures` record (no compiling, no chip):
each row's step estimate (`estimate`) and the markdown table with the line that says how it was made
(`format_table`). `tools.figures` renders it into the docs from docs/figures/cost/v5e-256.json."""

from __future__ import annotations

import math
from typing import Optional


def _chip_time(chip_rec: dict, vocab: int, part: str) -> Optional[float]:
    for r in chip_rec["rows"]:
        if r["V"] == vocab and r["part"] == part:
            return r["median_s"]
    return None


def estimate(payload: dict, row: dict) -> dict:
    """A row's step estimate in seconds: {'loss', 'optimizer', 'ici', 'step'} and the checkpoint per host."""
    chip_rec = payload["chip"]
    loss = _chip_time(chip_rec, row["V"], row["loss"])
    opt = _chip_time(chip_rec, row["V"], "optimizer")
    ici = sum(row["collective_bytes"].values()) / payload["ici_bytes_per_s"]
    ck = chip_rec["checkpoint"]
    host_bytes = row["state_bytes_per_chip"] * row["chips_per_host"]
    step = None if loss is None or opt is None else loss + opt + ici
    return dict(loss=loss, optimizer=opt, ici=ici, step=step, host_bytes=host_bytes,
                save_s=host_bytes / (ck["save_gb_s"] * 1e9), restore_s=host_bytes / (ck["restore_gb_s"] * 1e9))


def _ms(s: Optional[float]) -> str:
    if s is None:
        return "n/a"
    return f"{s:.2f} s" if s >= 1 else f"{s * 1e3:.1f} ms"


def _dominant(est: dict) -> str:
    parts = {"loss": est["loss"] or 0, "optimizer": est["optimizer"] or 0, "collectives": est["ici"]}
    top = max(parts, key=parts.get)
    return f"{top} ({parts[top] / max(sum(parts.values()), 1e-30):.0%})"


def format_table(payload: dict) -> str:
    """docs/sharding.md's cost table (markdown) and the line under it that says how it was measured."""
    chip_rec = payload["chip"]
    lines = ["| V | loss | HBM a chip (XLA / memory_analysis) | loss + grad | optimizer | collectives "
             "(MiB a chip) | step (estimate) | dominates | checkpoint a host | save / restore |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for row in payload["rows"]:
        est = estimate(payload, row)
        coll = sum(row["collective_bytes"].values())
        lines.append(f"| 10^{round(math.log10(row['V']))} | {row['loss']} ({row['strategy']}) | "
                     f"{row['xla_hbm_bytes'] / 2**30:.2f} / {row['hbm_bytes'] / 2**30:.2f} GiB | "
                     f"{_ms(est['loss'])} | {_ms(est['optimizer'])} | {coll / 2**20:,.0f} ({_ms(est['ici'])}) | "
                     f"{_ms(est['step'])} | {_dominant(est)} | {est['host_bytes'] / 2**30:.2f} GiB | "
                     f"{_ms(est['save_s'])} / {_ms(est['restore_s'])} |")
    ck = chip_rec["checkpoint"]
    first_save = ck["bytes"] / ck["save_s"][0] / 1e9
    stack = payload["stack"]
    probe = payload.get("probe")
    probed = ""
    if probe:
        part = lambda name: ", ".join(f"{_ms(r['median_s'])} at 10^{round(math.log10(r['V']))}"
                                      for r in probe["rows"] if r["part"] == name)
        probed = (f" Of the loss's time, the targets' logits and the scatter-add of their gradient into dE "
                  f"(`recloss.targets.gather_logits`, M·L rows) take {part('targets')}; the sampled draw of K "
                  f"ids {part('draw')} (`probe`).")
    lines += ["", f"Per-chip shapes: M = {payload['rows'][0]['shape']['M']:,} rows against V/256 table rows, "
              f"D = {payload['rows'][0]['shape']['D']}. Times: medians of {chip_rec['rounds']} interleaved rounds on "
              f"one {chip_rec['device']} (jax {chip_rec['jax']}), whose bf16 matmul ran at "
              f"{chip_rec['roof_flop_s_median'] / 1e12:.1f} TFLOP/s and copy at "
              f"{chip_rec['hbm_bytes_s_median'] / 1e9:.0f} GB/s in the same rounds. Collectives: the compiled step's "
              f"bytes received per chip at {payload['ici_bytes_per_s'] / 1e9:.0f} GB/s. Checkpoint: the chips' "
              f"state × {payload['rows'][0]['chips_per_host']} chips a host, at the Orbax rates measured on that "
              f"host's local disk, medians of {len(ck['save_s'])} ({ck['save_gb_s']:.2f} GB/s save: the first, into "
              f"a cold page cache, {first_save:.2f}; {ck['restore_gb_s']:.2f} GB/s restore).{probed} "
              f"HBM: jax {stack.get('jax')}, libtpu {stack.get('libtpu')}. Recorded by `{payload['command']}`."]
    return "\n".join(lines)
