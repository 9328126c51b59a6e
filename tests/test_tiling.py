"""recloss.pallas.tiling: the (8, 128) tiling rule, VMEM budgets and the chip table (no kernel runs)."""

import jax
import jax.numpy as jnp
import pytest

import recloss
from recloss.pallas import tiling

# `stack` (docs/development.md): the Pallas API and its interpreter change between jax versions
# (recloss/_compat.py absorbs the renames); the newest-stack leg runs this module.
pytestmark = [pytest.mark.tier1, pytest.mark.stack]


@pytest.mark.parametrize("chip", sorted(tiling.CHIPS))
def test_tiling_rules_and_budget(chip):
    c = tiling.CHIPS[chip]
    opts = recloss.LossOptions()
    for mode in tiling.MODES:
        for m, v, d, dt in ((4096, 876939, 128, jnp.float32), (4096, 876939, 128, jnp.bfloat16),
                            (2048, 876939, 256, jnp.float32), (32768, 100000, 128, jnp.float32),
                            (13, 300, 37, jnp.float32)):
            t = tiling.choose(mode, m, v, d, dt, dt, opts, bias=True, chip=c)
            assert t.bv % 128 == 0 and t.bs % tiling.sublanes(dt) == 0 and t.bn % t.bs == 0
            assert t.rows >= m and t.d_pad % 128 == 0 and t.d_pad >= d
            assert t.vmem_bytes <= c.budget_bytes < c.vmem_limit_bytes <= c.vmem_bytes
            assert t.cores == min(c.cores, -(-v // t.bv))
    # Too many rows for one resident tile → several chunks, each within budget.
    t = tiling.choose(("bce", "fused"), 65536, 100000, 256, jnp.float32, jnp.float32, opts, bias=True,
                      chip=tiling.CHIPS["v5p"])
    assert t.num_chunks > 1 and t.vmem_bytes <= tiling.CHIPS["v5p"].budget_bytes


def test_modes_and_their_estimates():
    assert set(tiling.MODES) == {("bce", "fused"), ("bce", "loss"), ("bce", "grad"), ("softmax", "loss"),
                                 ("softmax", "grad")}
    est = lambda mode, **kw: tiling.vmem_estimate(mode, 512, 256, 1024, 128, 4, 4, bias=True, **kw)
    # Gradient modes hold dA and dE_j; the softmax loss holds three lane vectors (max, sum-exp, id).
    sl, sg, bg = ("softmax", "loss"), ("softmax", "grad"), ("bce", "grad")
    assert est(sl, accumulate=False) < est(sg, accumulate=False)
    assert est(sg, accumulate=False) < est(sg, accumulate=True)
    assert est(sg, accumulate=False) < est(bg, accumulate=False)   # fewer temporaries
    with pytest.raises(ValueError, match="mode must be one of"):
        tiling.choose("softmax_loss", 8, 128, 8, jnp.float32, jnp.float32, recloss.LossOptions(), bias=False,
                      chip=tiling.GENERIC)


def test_chip_from_device_kind():
    assert tiling.chip_from_device_kind("TPU v6 lite").name == "v6e"
    assert tiling.chip_from_device_kind("TPU v5 lite").name == "v5e"
    v5p = tiling.chip_from_device_kind("TPU v5", num_cores=2)
    assert (v5p.name, v5p.cores, v5p.vmem_bytes) == ("v5p", 2, 64 * tiling.MiB)
    assert tiling.chip_from_device_kind("TPU v5", num_cores=1).cores == 1     # split mode
    assert tiling.chip_from_device_kind("TPU7x").mxu == 256
    assert tiling.chip_from_device_kind("cpu") is tiling.GENERIC
    assert tiling.get_chip() is tiling.GENERIC      # CPU default device, no mesh


@pytest.mark.parametrize("chip", sorted(set(tiling.CHIPS) - {"v4"}))
@pytest.mark.parametrize("d", [2304, 4096])
def test_wide_hidden_states_shrink_the_blocks_to_fit(chip, d):
    """LLM decoders' D (Gemma 2,304, Llama 4,096): the [bv, D] and [bs, D] blocks, not the
    logit temporaries, are what must shrink; every sweep still fits the budget with >= 128-wide blocks."""
    c = tiling.CHIPS[chip]
    for mode in tiling.MODES:
        for dt in (jnp.float32, jnp.bfloat16):
            t = tiling.choose(mode, 65536, 128256, d, dt, dt, recloss.LossOptions(), bias=False, chip=c)
            assert t.vmem_bytes <= c.budget_bytes and t.bv >= 128 and t.bs >= 128, (mode, dt, t)
            assert t.bv % 128 == 0 and t.bn % t.bs == 0 and t.rows >= 65536
    # An explicit block_v is kept: the rows shrink instead, or the error names it.
    t = tiling.choose(("softmax", "grad"), 4096, 128256, 4096, jnp.float32, jnp.float32,
                      recloss.LossOptions(block_v=512), bias=False, chip=tiling.CHIPS["v6e"])
    assert t.bv == 512
    # v4's 12 MiB VMEM limit holds no 128 x 128 block pair at D = 4,096: a clear error, not a compile failure.
    with pytest.raises(ValueError, match=r"cannot tile D=4096 .* on chip 'v4'"):
        tiling.choose(("bce", "fused"), 4096, 128256, 4096, jnp.float32, jnp.float32, recloss.LossOptions(),
                      bias=False, chip=tiling.CHIPS["v4"])


@pytest.mark.parametrize("ambient, f32_precision", [
    (None, "DEFAULT"), ("default", "DEFAULT"), ("bfloat16", "DEFAULT"), ("BF16_BF16_F32", "DEFAULT"),
    ("high", "HIGHEST"), ("tensorfloat32", "HIGHEST"), ("BF16_BF16_F32_X3", "HIGHEST"),
    ("highest", "HIGHEST"), ("float32", "HIGHEST"), ("F32_F32_F32", "HIGHEST")])
def test_kernel_products_take_the_ambient_precision_mosaic_can_run(ambient, f32_precision):
    # Mosaic runs DEFAULT and HIGHEST only, and HIGHEST only on 32-bit operands; 16-bit products are
    # exact in the f32 accumulator whatever is asked.
    from recloss.pallas import grid
    with jax.default_matmul_precision(ambient):
        assert grid.dot_precision(jnp.float32) == getattr(jax.lax.Precision, f32_precision)
        assert grid.dot_precision(jnp.bfloat16) == jax.lax.Precision.DEFAULT


def test_float16_operands_are_tiled_as_the_float32_the_kernel_holds():
    assert tiling.kernel_dtype(jnp.float16) == jnp.float32
    assert tiling.kernel_dtype(jnp.bfloat16) == jnp.bfloat16
    chip = tiling.get_chip("v5e")
    opts = recloss.LossOptions()
    f16 = tiling.choose(("bce", "fused"), 4096, 100_000, 256, jnp.float16, jnp.float16, opts, bias=True, chip=chip)
    f32 = tiling.choose(("bce", "fused"), 4096, 100_000, 256, jnp.float32, jnp.float32, opts, bias=True, chip=chip)
    assert f16 == f32


def _fake_table(monkeypatch, entries, chip="v5e"):
    from recloss.pallas import tuned
    monkeypatch.setattr(tuned, "table", lambda name: dict(chip=chip, entries=entries) if name == chip else None)


def test_a_measured_entry_is_read_and_a_missing_one_falls_back(monkeypatch):
    """`recloss.pallas.tuned`: the chip's entry for the mode and table dtype (the nearest D) sets the
    automatic sub-tile and vocab block; another dtype, mode or chip keeps the heuristic, and an explicit
    block_v still wins."""
    f32, bf16 = jnp.float32, jnp.bfloat16
    _fake_table(monkeypatch, [dict(objective="bce", mode="fused", dtype="float32", d=256, bs=1024, bv=2048),
                              dict(objective="bce", mode="fused", dtype="float32", d=1024, bs=256, bv=512)])
    opts = recloss.LossOptions()
    choose = lambda mode, dt, d, chip="v5e", o=opts: tiling.choose(mode, 2048, 876_939, d, dt, dt, o, bias=False,
                                                                  chip=tiling.get_chip(chip), temps=3)
    heuristic = choose(("bce", "fused"), bf16, 256)
    assert (heuristic.bs, heuristic.bv) == (512, 1024)                     # no bfloat16 entry
    assert (choose(("bce", "fused"), f32, 256).bs, choose(("bce", "fused"), f32, 256).bv) == (1024, 2048)
    assert (choose(("bce", "fused"), f32, 200).bs, choose(("bce", "fused"), f32, 200).bv) == (1024, 2048)  # nearest D
    assert (choose(("bce", "fused"), f32, 900).bs, choose(("bce", "fused"), f32, 900).bv) == (256, 512)
    other = choose(("bce", "loss"), f32, 256)
    assert (other.bs, other.bv) == (heuristic.bs, heuristic.bv)            # no entry for the mode
    v6e = choose(("bce", "fused"), f32, 256, chip="v6e")
    assert (v6e.bs, v6e.bv) == (512, 1024)                                 # no table for the chip
    explicit = choose(("bce", "fused"), f32, 256, o=recloss.LossOptions(block_v=256))
    assert explicit.bv == 256 and explicit.bs == 1024


def test_the_shipped_tables_are_whole_valid_and_the_docs_name_them():
    """Every table in the package names its chip and how it was measured, and each entry is a mode of
    `tiling.MODES` with blocks the tiling rule takes; docs/kernels.md names exactly the chips that have one."""
    import pathlib
    import re
    from recloss.pallas import tuned
    names = tuned.chips()
    docs = (pathlib.Path(__file__).resolve().parent.parent / "docs" / "kernels.md").read_text()
    listed = re.search(r"<!-- tuned-chips -->(.*?)<!-- /tuned-chips -->", docs).group(1)
    assert listed == (", ".join(names) if names else "none"), (listed, names)
    for name in names:
        t = tuned.table(name)
        assert t["chip"] == name and name in tiling.CHIPS
        assert {"device", "jax", "libtpu", "date", "command"} <= set(t["measured"])
        for e in t["entries"]:
            assert (e["objective"], e["mode"]) in tiling.MODES, e
            assert e["bv"] % tiling.LANES == 0 and e["bs"] % 16 == 0 and e["d"] > 0, e
            assert e["ms"] <= e["heuristic_ms"], e
