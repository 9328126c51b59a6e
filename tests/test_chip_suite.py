"""The on-chip suite (`recloss-bench --chip`, `recloss.bench.chip`) and `make test-tpu`, off the chip: the
roofline probes of the kernel grid in interpret mode, the suite's refusals, the bound and ratios it derives
from its medians, and the record `make test-tpu` writes refusing a CPU backend."""

import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import recloss
from helpers import assert_close
from recloss.bench import chip, cli
from recloss.pallas import grid
from recloss.shard import VocabShard

pytestmark = pytest.mark.tier1


def _fused(a, e, r, probe):
    # Rows in two chunks and three vocab blocks (the last partial): every part of the grid runs.
    from recloss.bce import kernel
    strategy = recloss.get_strategy("cutbce_pallas", block_v=128, block_n=16)
    shard = VocabShard.whole(e, None, vocab_size=e.shape[0], platform="cpu")
    plan = strategy.plan(a.shape[0], shard)
    sweeps = kernel.sweeps(None if probe is None else lambda spec: grid.probe(spec, probe))
    return sweeps.fused(a, e, None, r, 0, plan, None)


def test_the_matmuls_probe_runs_only_the_three_products(rng):
    a = jnp.asarray(rng.normal(size=(29, 24)), jnp.float32)
    e = jnp.asarray(rng.normal(size=(300, 24)) / 5, jnp.float32)
    r = jnp.asarray(rng.uniform(0.5, 2.0, size=(29,)), jnp.float32)
    x = np.asarray(a, np.float64) @ np.asarray(e, np.float64).T
    with jax.default_matmul_precision("highest"):
        probe = _fused(a, e, r, "matmuls")
        real = _fused(a, e, r, None)
    # G = X: dA = X E, dE = Xᵀ A, and the row output Σ_v X, whatever r and the loss math would make them.
    assert_close(probe.da, x @ np.asarray(e, np.float64), 1e-5, "dA of the matmuls probe")
    assert_close(probe.de, x.T @ np.asarray(a, np.float64), 1e-5, "dE of the matmuls probe")
    assert_close(probe.value, x.sum(axis=1), 1e-5, "row sums of the matmuls probe")
    assert np.linalg.norm(np.asarray(real.da) - np.asarray(probe.da)) > 0.1 * np.linalg.norm(np.asarray(real.da))


def test_the_elementwise_probe_runs_no_product(rng):
    a = jnp.asarray(rng.normal(size=(29, 24)), jnp.float32)
    e = jnp.asarray(rng.normal(size=(300, 24)) / 5, jnp.float32)
    r = jnp.ones((29,), jnp.float32)
    probe = _fused(a, e, r, "elementwise")
    assert np.all(np.asarray(probe.de) == 0.0), "the elementwise probe wrote a product into dE"
    assert np.all(np.isfinite(np.asarray(probe.value))) and np.all(np.isfinite(np.asarray(probe.da)))
    # The stand-in X depends on the rows' first feature only: the loss math ran on it, not on A Eᵀ.
    assert not np.allclose(np.asarray(probe.value), np.asarray(_fused(a, e, r, None).value))


def test_probe_names_its_choices():
    from recloss.bce import kernel
    spec = kernel._spec("fused", recloss.LossOptions(), 128)
    with pytest.raises(ValueError, match=r"probe must be one of \('matmuls', 'elementwise'\), got 'mxu'"):
        grid.probe(spec, "mxu")


def test_the_suite_times_its_probes_through_the_strategy(rng):
    """`chip.probe_strategy`: the strategy's own call with its kernels' specs as the probe (the loss of
    the matmuls probe is not the strategy's), and the strategy itself untouched after."""
    h = jnp.asarray(rng.normal(size=(2, 9, 24)), jnp.float32)
    e = jnp.asarray(rng.normal(size=(300, 24)) / 5, jnp.float32)
    t = jnp.asarray(rng.integers(0, 300, size=(2, 9, 3)), jnp.int32)
    real = float(recloss.bce_loss(h, e, t, strategy="cutbce_pallas").loss)
    probed = float(chip.probe_strategy("cutbce_pallas", "matmuls")(h, e, t).loss)
    assert np.isfinite(probed) and probed != real
    assert float(recloss.bce_loss(h, e, t, strategy="cutbce_pallas").loss) == real


def test_the_suite_refuses_a_cpu_backend_and_unknown_shapes(capsys):
    with pytest.raises(ValueError, match=r"unknown suite shape\(s\) \['paper'\]: expected some of \['table2-f32'"):
        chip.run(["paper"])
    with pytest.raises(RuntimeError, match="the on-chip suite measures a TPU; JAX's backend here is 'cpu'"):
        chip.run(["paper-f32"])
    for argv, msg in ((["--chip"], "--chip measures a TPU: JAX's backend here is 'cpu'"),
                      (["--chip", "--chip-shapes", "paper-f32,huge"], "--chip-shapes: unknown shape(s) ['huge']")):
        with pytest.raises(SystemExit) as exit_:
            cli.main(argv)
        assert exit_.value.code == 2 and msg in capsys.readouterr().err


def _row(shape, row, kind, ms, dtype="float32", **extra):
    return dict(shape=shape, row=row, kind=kind, median_ms=ms, B=8, N=256, V=1000, D=256, L=8, dtype=dtype,
                temp_mib=1.0, **extra)


def test_the_bound_is_the_largest_floor_and_the_ratios_are_the_medians():
    rows = [_row("s-f32", "cutbce_pallas", "strategy", 10.0, bytes_accessed=5e9, check="passed"),
            _row("s-f32", chip.CHAIN, "chain", 8.0),
            _row("s-f32", "cutbce_pallas [matmuls]", "probe", 6.0),
            _row("s-f32", "cutbce_pallas [elementwise]", "probe", 9.0),
            _row("s-bf16", "cutbce_pallas", "strategy", 11.0, dtype="bfloat16", bytes_accessed=2e10, check="passed"),
            _row("s-bf16", chip.CHAIN, "chain", 10.0, dtype="bfloat16"),
            _row("s-bf16", "cutbce_pallas [matmuls]", "probe", 6.0, dtype="bfloat16"),
            _row("s-bf16", "cutbce_pallas [elementwise]", "probe", 9.5, dtype="bfloat16")]
    info = dict(roof_tflops=100.0, hbm_gbps=1000.0)
    chip._derive(rows, info)
    assert rows[0]["floors_ms"] == {"MXU": 6.0, "VPU/EUP": 9.0, "HBM": 5.0} and rows[0]["bound"] == "VPU/EUP"
    assert rows[4]["floors_ms"]["HBM"] == 20.0 and rows[4]["bound"] == "HBM"
    useful = 6 * 8 * 256 * 1000 * 256
    assert rows[0]["useful_tflops"] == round(useful / 0.010 / 1e12, 1)
    assert rows[0]["roof_fraction"] == round(useful / 0.010 / 100e12, 3)
    summary = chip.format_summary(dict(info=info, rows=rows))
    assert "÷ the XLA chain: s-f32 1.25, s-bf16 1.10" in summary
    assert "bfloat16 ÷ float32 inputs: s 1.10" in summary and "bound by s-f32 VPU/EUP, s-bf16 HBM" in summary
    table = chip.format_table(dict(info=dict(info, device="TPU v5 lite", jax="j", libtpu="l", tokamax=None, rounds=9,
                                             roof="r", copy="c"), rows=rows))
    # A probe's time is a floor, not a rate: no useful TFLOP/s or share of the roof in its row.
    probe_line = next(line for line in table.splitlines() if "[matmuls]" in line and "s-f32" in line)
    assert "| 6.00 |  |  | 1.0 | no loss |" in probe_line


def test_test_tpu_refuses_a_cpu_backend(tmp_path):
    # `make test-tpu`'s pytest option: on this CPU backend the session stops before any test runs.
    record = tmp_path / "tests.json"
    run = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "no:xdist",
                          "--tpu-record", str(record), "tests/test_chip_suite.py::test_probe_names_its_choices"],
                         capture_output=True, text=True, env=dict(os.environ, JAX_PLATFORMS="cpu"),
                         cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    assert run.returncode == 4, run.stdout + run.stderr
    assert "`make test-tpu` runs on a TPU host, but JAX's backend is 'cpu'" in run.stdout + run.stderr
    assert not record.exists()


def test_the_test_tpu_record_renders_its_counts():
    line = chip.format_tests(dict(device="TPU v5 lite", jax="0.10.2", libtpu="0.0.42.1", date="2026-12-06",
                                  matmul_precision="highest", seconds=231.8, failed=["t::a"],
                                  counts=dict(passed=3, failed=1, error=0, skipped=2)))
    assert line == ("`make test-tpu` on TPU v5 lite (jax 0.10.2, libtpu 0.0.42.1, 2026-12-06, matmul precision "
                    "highest): 3 passed, 1 failed, 0 errors, 2 skipped in 232 s; failed: t::a.")


def test_tune_refuses_a_cpu_backend_and_writes_a_table_the_tiling_reads(capsys, monkeypatch):
    """`recloss-bench --tune` measures a TPU (a CPU backend is refused, naming it); its payload becomes the
    package table `recloss.pallas.tuned` reads, and `tune.forced` is what a candidate compiles under."""
    from recloss.bench import tune
    from recloss.pallas import tiling, tuned
    with pytest.raises(SystemExit) as exit_:
        cli.main(["--tune"])
    assert exit_.value.code == 2 and "--tune measures a TPU: JAX's backend here is 'cpu'" in capsys.readouterr().err
    with pytest.raises(RuntimeError, match="--tune measures a TPU"):
        tune.run(["paper-f32"])
    payload = dict(info=dict(chip="v5e", device="TPU v5 lite", jax="x", libtpu="y", date="d", rounds=5),
                   entries=[dict(objective="bce", mode="fused", dtype="float32", d=256, bs=1024, bv=2048, ms=1.0,
                                 heuristic_ms=2.0)],
                   shapes={"paper-f32": {"heuristic": dict(median_ms=2.0, picks={"fused": [512, 1024]}),
                                         "bs=1024 bv=2048": dict(bs=1024, bv=2048, median_ms=1.0)}})
    table = tune.table(payload, "recloss-bench --tune")
    assert table["chip"] == "v5e" and table["measured"]["command"] == "recloss-bench --tune"
    assert "| paper-f32 | bs=1024 bv=2048 | 1.00 | 0.500 |" in tune.format_table(payload)
    monkeypatch.setattr(tuned, "table", lambda name: table if name == "v5e" else None)
    pick = lambda: tiling.choose(("bce", "fused"), 2048, 10_000, 256, jnp.float32, jnp.float32, recloss.LossOptions(),
                                 bias=False, chip=tiling.get_chip("v5e"), temps=3)
    assert (pick().bs, pick().bv) == (1024, 2048)
    with tune.forced("v5e", "bce", "float32", 256, 512, 512):
        assert (pick().bs, pick().bv) == (512, 512)
    with tune.unforced("v5e"):
        assert (pick().bs, pick().bv) == (512, 1024)
    assert (pick().bs, pick().bv) == (1024, 2048)
