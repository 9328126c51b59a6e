"""The whole SASRec train step compiled ahead of time for TPU pods: per-chip HBM against the record.

The pinned rows of the docs' pod tables (`tools.figures.POD_TABLES`: the paper step on v6e-8
data parallel, with the table over fsdp 8 with the ring and over 8 vocab shards; on v5e-256 a 10^7-item
table over 8 vocab shards and over fsdp 8 with the ring and with the rows gathered, and a 10^8-item
one over 64 vocab shards) are compiled as `recloss-train ... compile_topology=...` does
and compared with this stack's record, ``docs/figures/pod/jax-<jax>_libtpu-<libtpu>.json``, the file
docs/sharding.md renders its tables from. XLA's compile is deterministic for a given jax/libtpu, so
a regression of more than 5 % fails; the largest buffers at the peak are printed
(`recloss.aot`) so a failure says what grew. A stack with no record is held to the
worst recorded figure of each row.

Each compile takes one to two minutes of CI's two cores, so each pinned row is compiled on one leg: the
jax floor's (leg 1) takes every other row in table order, any other stack (leg 2) the rest, and the 10^9
row is checked on both by the billion-config test, which compiles that same step anyway; the billion
sampled step is compiled on leg 2 only.
``RECLOSS_POD_PINS=all`` compiles every pinned row here.
"""

from __future__ import annotations

import importlib.util
import os
import re
import tempfile

import pytest

pytestmark = [
    pytest.mark.tier2, pytest.mark.tpu_aot,
    pytest.mark.skipif(importlib.util.find_spec("libtpu") is None,
                       reason="libtpu is not importable (pip install 'jax[tpu]'): no TPU AOT compiler"),
]

import jax  # noqa: E402

from recloss import aot
from tools import figures  # noqa: E402
from tools import pod_figures  # noqa: E402

PINNED = {name: cr for name, cr in figures.pod_rows().items() if cr[1].pinned}
BILLION_ROW = "v5e-256 V=1e9, vocab 256"    # configs/sasrec_billion.yml as the pod table's overrides


def _on_the_floor() -> bool:
    """This stack's jax is the floor pyproject.toml requires (CI's leg 1)."""
    floor = re.search(r'"jax>=([0-9.]+)"', (figures.ROOT / "pyproject.toml").read_text()).group(1)
    return jax.__version__ == floor


def _rows_here():
    rows = [n for n in PINNED if n != BILLION_ROW]
    if os.environ.get("RECLOSS_POD_PINS") == "all":
        return rows
    return rows[0::2] if _on_the_floor() else rows[1::2]


def _records():
    """{stack stem: {pod_key: row}} of every committed pod record."""
    return {p.stem: figures.load_pod(p)[1] for p in sorted(figures.POD_DIR.glob("*.json"))}


def test_every_stack_records_every_row():
    """Both legs' records hold every row of every pod table (the docs render from them)."""
    records = _records()
    assert records, f"no pod records under {figures.POD_DIR}: {figures.POD_RECORD}"
    for stem, rows in records.items():
        for name, (config, row) in figures.pod_rows().items():
            assert figures.pod_key(config, row.overrides) in rows, (
                f"{stem}.json has no row {name!r}: {figures.POD_RECORD} on that stack")


@pytest.mark.parametrize("case", _rows_here())
def test_train_step_hbm_per_chip_matches_the_record(case):
    config, row = PINNED[case]
    rec = pod_figures.compile_row(config, row.overrides)
    print(f"\n{case} (jax {jax.__version__}): {rec['hbm_bytes'] / 2**30:.3f} GiB per chip\n{aot.report(rec['peak'])}")
    _check_the_record(case, rec["hbm_bytes"])


def _check_the_record(case, hbm_bytes):
    """The pod row ``case``'s per-chip bytes against this stack's record (5 % allowed)."""
    config, row = PINNED[case]
    key = figures.pod_key(config, row.overrides)
    records = _records()
    mine = figures.stack_id(figures.current_stack())
    gib = hbm_bytes / 2**30
    if mine in records:
        pin, source = records[mine][key]["hbm_bytes"] / 2**30, f"{mine}.json"
    else:   # a stack not recorded yet: the worst figure of the recorded ones bounds it
        pin, source = max(r[key]["hbm_bytes"] for r in records.values()) / 2**30, "the worst record"
    assert gib <= 1.05 * pin, f"{case}: {gib:.3f} GiB per chip, recorded {pin:.3f} in {source} (+5 % allowed)"


def test_the_billion_item_config_fits_a_v5e_chip_with_its_evaluation():
    """configs/sasrec_billion.yml (V = 10^9 over a v5e-256 slice) compiled as `recloss-train CONFIG
    compile_topology=v5e-256` does: the train step and the evaluation program each within 14 GiB per
    chip by XLA's own count (what the chip enforces; a v5e has 15.75), and the step's per-chip bytes
    are its pod-table row's record (the same program)."""
    from recloss_plugins.config import load_config
    from recloss_plugins.sasrec import aot as step_aot

    cfg = load_config([str(figures.ROOT / "configs" / "sasrec_billion.yml"), "compile_topology=v5e-256"])
    assert cfg.vocab_size == 10 ** 9
    out = step_aot.compile_report(cfg, log=print)
    assert out["xla_bytes"] <= 14 * 2 ** 30, out["xla_bytes"] / 2 ** 30
    assert out["eval_xla_bytes"] <= 14 * 2 ** 30, out["eval_xla_bytes"] / 2 ** 30
    _check_the_record(BILLION_ROW, out["memory"]["total"])


def test_the_billion_item_sampled_step_holds_its_proposal_split_like_the_table():
    """The same config with `sampled_softmax` at K = 512 drawing from the training counts: the proposal is
    the step's [rows] argument split over the 256 vocab shards (4 bytes a row a chip, no [V] array, no
    captured constant), and the step stays within the exact one's budget by XLA's count. Compiled on the
    newest stack's leg (two minutes of CI's two cores a leg); ``RECLOSS_POD_PINS=all`` compiles it here too."""
    if _on_the_floor() and os.environ.get("RECLOSS_POD_PINS") != "all":
        pytest.skip("compiled on the newest stack's leg (leg 2); RECLOSS_POD_PINS=all compiles it on this one")
    from recloss_plugins.config import load_config
    from recloss_plugins.sasrec import aot as step_aot, parallel

    cfg = load_config([str(figures.ROOT / "configs" / "sasrec_billion.yml"), "compile_topology=v5e-256",
                       "loss=sampled_softmax", "num_negatives=512", "sampled_proposal=counts"])
    devices = parallel.topology_devices(cfg.compile_topology, 1)
    with tempfile.TemporaryDirectory() as dump:
        compiled, rep, program = step_aot.compile_step(cfg, devices, cfg.vocab_size, dump_to=dump)
        xla = aot.hbm_bytes(dump)
    (lq,) = jax.tree.leaves(program.abstract_inputs())
    assert lq.shape == (program.rows,) and lq.sharding.shard_shape(lq.shape) == (program.rows // 256,)
    assert rep["argument"] < 2.1 * 2 ** 30, rep["argument"] / 2 ** 30     # the bf16 table shard (1.86 GiB) and small
    assert xla <= 8 * 2 ** 30, xla / 2 ** 30
