"""recloss-bench on CPU: every row runs, computes the same loss, and reports what it measured.

Timings are not asserted (a shared machine varies 2x); the structure, the loss
agreement between rows and the deterministic compiled memory are.
"""

import json
from pathlib import Path

import pytest

from recloss.bce import cut
from recloss.bench import cli

SMALL = ["--batch", "2", "--seq", "24", "--vocab", "3001", "--dim", "20", "--labels", "3", "--repeats", "2"]


@pytest.mark.tier1
def test_cpu_rows_agree_and_report(tmp_path, capsys):
    out = tmp_path / "bench.json"
    assert cli.main(SMALL + ["--json", str(out)]) == 0
    text = capsys.readouterr().out
    payload = json.loads(out.read_text())
    rows = {r["strategy"]: r for r in payload["rows"]}
    assert set(rows) == {"dense_bce", cli.OPTAX_LABEL, "cutbce (fused)", "cutbce (recompute, paper design)",
                         cli.MATMULS_ONLY}
    losses = [r["loss"] for r in rows.values() if r["loss"] is not None]
    assert len(losses) == 4 and rows[cli.MATMULS_ONLY]["loss"] is None
    assert max(losses) - min(losses) <= 1e-5 * abs(min(losses)), losses
    assert "loss values of the rows agree" in text
    for r in rows.values():
        assert r["repeats"] == 2 and r["median_s"] > 0 and r["gflops_per_s"] > 0
        assert r["batch"] == 2 and r["vocab"] == 3001
    assert rows["cutbce (recompute, paper design)"]["nominal_gflop"] == pytest.approx(
        8 / 6 * rows["cutbce (fused)"]["nominal_gflop"])
    # The dense rows hold [BN, V] logits; at this size one cutbce tile is the whole
    # block, so only "smaller" is asserted here (test_bce_memory has the real bound).
    assert rows["dense_bce"]["temp_mib"] * 2**20 >= 2 * 24 * 3001 * 4
    assert rows["cutbce (fused)"]["temp_mib"] < rows["dense_bce"]["temp_mib"]
    assert payload["info"]["matmul_gflops_per_s"] > 0
    assert "| cutbce (fused) | 2×24 | 3,001 | 20 |" in text


@pytest.mark.tier1
def test_matmuls_only_ceiling_changes_no_library_code(rng):
    import jax.numpy as jnp
    import numpy as np

    import recloss
    from recloss.bench import rows

    h = jnp.asarray(rng.normal(size=(7, 12)), jnp.float32)
    e = jnp.asarray(rng.normal(size=(50, 12)), jnp.float32)
    t = jnp.asarray(rng.integers(0, 50, size=(7, 2)), jnp.int32)
    real, before = cut.Bernoulli.parts, float(recloss.bce_loss(h, e, t).loss)
    ceiling = float(rows.matmuls_only_loss(h, e, t, block_v=16))
    # value = logit: the loss part is Σ_i r_i·Σ_v x_iv (r = 1/(M·V)) plus the (real) target correction.
    assert np.isfinite(ceiling) and ceiling != before
    assert cut.Bernoulli.parts is real and float(recloss.bce_loss(h, e, t).loss) == before


@pytest.mark.tier1
@pytest.mark.parametrize("argv, message", [
    (["--strategies", "optax", "--topology", "v6e-8"], "--strategies optax is a CPU timing baseline"),
    (["--repeats", "0"], "--repeats must be >= 1, got 0"),
    (["--vocab", "-3"], "--vocab must be a positive int, got -3"),
    (["--sampled-bias", "--draws", "1"], "--draws must be >= 2 (a mean over draws), got 1"),
    (["--sampled-bias", "--topology", "v6e-8"], "--sampled-bias runs on this machine with its own rows"),
    (["--largest-vocab"], "--largest-vocab compiles for a TPU chip: add --topology"),
    (["--largest-vocab", "--topology", "v6e-8", "--vocab", "1000"], "--largest-vocab finds V itself"),
    (["--largest-vocab", "--topology", "v6e-8", "--strategies", "optax"],
     "--largest-vocab compiles recloss strategies, not 'optax'"),
])
def test_bad_arguments_name_the_value(argv, message, capsys):
    with pytest.raises(SystemExit):
        cli.main(argv)
    assert message in capsys.readouterr().err


@pytest.mark.tier1
def test_unknown_strategy_lists_the_known_ones():
    with pytest.raises(ValueError, match="cutbce"):
        cli.main(["--strategies", "cutbse"])


SOFTMAX_SMALL = ["--objective", "softmax", "--batch", "2", "--seq", "24", "--vocab", "3001", "--dim", "20",
                 "--repeats", "2"]


@pytest.mark.tier1
@pytest.mark.parametrize("labels", [3, 1])
def test_softmax_rows_agree_and_report(labels, tmp_path, capsys):
    """dense_ce, the optax code users write and cutce compute one loss; the table and the
    agreement line are printed; Tokamax is a row with L=1 when it imports, a printed skip otherwise."""
    out = tmp_path / "bench.json"
    assert cli.main(SOFTMAX_SMALL + ["--labels", str(labels), "--json", str(out)]) == 0
    text = capsys.readouterr().out
    payload = json.loads(out.read_text())
    rows = {r["strategy"]: r for r in payload["rows"]}
    ours = {"dense_ce", cli.OPTAX_SOFTMAX_LABEL, "cutce"}
    assert ours <= set(rows)
    losses = [rows[s]["loss"] for s in ours]
    assert max(losses) - min(losses) <= 1e-5 * abs(min(losses)), losses
    assert "loss values of the rows (dense_ce, optax.softmax_cross_entropy (dense, autodiff), cutce) agree" in text
    assert "| cutce | 2×24 | 3,001 | 20 |" in text
    assert rows["cutce"]["nominal_gflop"] == pytest.approx(8 / 6 * rows["dense_ce"]["nominal_gflop"])
    assert rows["dense_ce"]["temp_vs_dense"] == 1.0 and rows["cutce"]["temp_mib"] < rows["dense_ce"]["temp_mib"]
    assert "cutce at 8·BN·V·D" in text and payload["info"]["objective"] == "softmax"
    peers = [r for r in payload["rows"] if r.get("peer")]
    if labels != 1:
        assert not peers and "skipped tokamax:" in text
    elif peers:      # Tokamax installed: its dense 'xla' computes our loss exactly
        xla = rows["tokamax xla"]
        assert xla["loss"] == pytest.approx(rows["dense_ce"]["loss"], rel=1e-5)
        assert "cutce / tokamax xla: time" in text
    else:
        assert "skipped tokamax: import tokamax failed" in text


@pytest.mark.tier1
def test_softmax_peer_needs_the_softmax_objective(capsys):
    with pytest.raises(SystemExit):
        cli.main(["--strategies", "tokamax"])
    assert "--strategies tokamax is a softmax peer: use --objective softmax" in capsys.readouterr().err


@pytest.mark.tier1
def test_strategy_of_another_objective_is_named(capsys):
    with pytest.raises(SystemExit):
        cli.main(["--objective", "softmax", "--strategies", "cutbce"])
    assert "strategy 'cutbce' computes the 'bce' objective" in capsys.readouterr().err


@pytest.mark.tier1
def test_chunked_padding_bias_is_exp0_per_padded_column():
    """The offset `peers.padding_bias` predicts is log(e^Z + pad) − Z, exactly."""
    import numpy as np

    from recloss.bench import peers

    z = np.array([3.0, 7.5])
    bias, pad = peers.padding_bias(z, 3001, v_block=2048)
    assert pad == 1095
    assert bias == pytest.approx(np.mean(np.log(np.exp(z) + pad) - z), rel=1e-6)


# ------------------------------------------------------------------ --plot and the version
@pytest.mark.tier1
def test_version_is_the_package_metadata_one():
    import tomllib
    from importlib import metadata
    from pathlib import Path

    import recloss

    pyproject = tomllib.loads((Path(__file__).parents[1] / "pyproject.toml").read_text())
    assert recloss.__version__ == metadata.version("recloss") == pyproject["project"]["version"]


def _fake_payload(rng):
    """A `plot.collect` payload with fresh random numbers: HBM grows with V, dense OOMs at the top."""
    from recloss.bench import plot

    vocabs = (100_000, 1_000_000, 10_000_000)
    rows, cpu = [], []
    for name in plot.TOPOLOGY_STRATEGIES:
        for v in vocabs:
            oom = name.startswith("dense") and v == vocabs[-1]
            hbm = "OOM" if oom else int(v * rng.uniform(1e3, 1e4))
            rows.append(dict(topology="v6e-8", strategy=name, B=8, N=256, D=256, V=v, L=8, hbm_bytes=hbm,
                             temp_bytes=hbm, flops=None, ideal_flops=1, compile_s=1.0))
    for objective, names in plot.CPU_STRATEGIES.items():
        for name in names:
            for v in vocabs[:2]:
                cpu.append(dict(objective=objective, strategy=name, vocab=v, median_s=float(rng.uniform(0.1, 2))))
    info = dict(topology="v6e-8", topology_shape=plot.TOPOLOGY_SHAPE, cpu_shape=plot.CPU_SHAPE, repeats=3,
                jax_version="x", recloss_version="y", cpu_count=2)
    return dict(topology=rows, cpu=cpu, info=info)


@pytest.mark.tier1
def test_plot_draws_hbm_and_cpu_time_against_v_with_oom_marked(tmp_path, rng):
    import numpy as np
    pytest.importorskip("matplotlib", reason="the `plot` extra (matplotlib) is not installed")
    from matplotlib import image

    from recloss.bench import plot

    payload = _fake_payload(rng)
    path = tmp_path / "bench.png"
    fig = plot.render(payload, str(path))
    hbm, cpu = fig.axes
    assert hbm.get_xscale() == hbm.get_yscale() == cpu.get_xscale() == "log"
    assert [t.get_text() for t in hbm.get_legend().get_texts()] == list(plot.TOPOLOGY_STRATEGIES)
    assert [t.get_text() for t in cpu.get_legend().get_texts()] == ["dense_bce", "cutbce", "dense_ce", "cutce"]
    # Each line holds the strategy's measured GiB, in V order; OOM cells are not on it but an x on the HBM line.
    for line in hbm.get_lines()[:len(plot.TOPOLOGY_STRATEGIES)]:
        want = sorted((r["V"], r["hbm_bytes"] / 2**30) for r in payload["topology"]
                      if r["strategy"] == line.get_label() and r["hbm_bytes"] != "OOM")
        np.testing.assert_allclose(np.c_[line.get_xdata(), line.get_ydata()], want)
    marks = [c.get_offsets() for c in hbm.collections]
    assert len(marks) == 2 and all(np.allclose(m, [[10_000_000, plot.HBM_GIB["v6e-8"]]]) for m in marks)
    assert any("out of HBM" in t.get_text() for t in hbm.texts)
    pixels = image.imread(str(path))
    assert pixels.shape[0] > 500 and pixels.shape[1] > 1500 and pixels.std() > 0.05   # drawn, not blank


@pytest.mark.tier1
def test_plot_needs_matplotlib_and_says_how_to_get_it(monkeypatch, capsys, tmp_path):
    import sys
    monkeypatch.setitem(sys.modules, "matplotlib", None)     # import matplotlib -> ImportError
    with pytest.raises(SystemExit):
        cli.main(["--plot", str(tmp_path / "x.png")])
    assert "pip install 'recloss[plot]'" in capsys.readouterr().err
    assert not (tmp_path / "x.png").exists()


@pytest.mark.tier2
@pytest.mark.tpu_aot
def test_plot_command_compiles_for_v6e_times_on_cpu_and_writes_the_png(monkeypatch, tmp_path):
    """`recloss-bench --plot` end to end on a small sweep: dense_bce runs out of v6e HBM at V=10^7
    (a [2048, 10^7] float32 logits array is 76 GiB), cutbce does not, and the PNG is written."""
    pytest.importorskip("matplotlib", reason="the `plot` extra (matplotlib) is not installed")
    from recloss.bench import plot

    monkeypatch.setattr(plot, "QUICK", dict(
        topology_strategies=("dense_bce", "cutbce"), topology_vocabs=(100_003, 10_000_000),
        topology_shape=dict(B=8, N=256, D=128, L=8), cpu_strategies={"bce": ("dense_bce", "cutbce")},
        cpu_vocabs=(2_001,), cpu_shape=dict(batch=2, seq=16, dim=24, labels=3)))
    png, js = tmp_path / "bench.png", tmp_path / "bench.json"
    assert cli.main(["--plot", str(png), "--quick", "--repeats", "2", "--json", str(js)]) == 0
    payload = json.loads(js.read_text())
    hbm = {(r["strategy"], r["V"]): r["hbm_bytes"] for r in payload["topology"]}
    assert hbm[("dense_bce", 10_000_000)] == "OOM"
    assert isinstance(hbm[("cutbce", 10_000_000)], int)
    # cutbce holds the table, its gradient and a copy or two (V·D·4 bytes each) plus O(block) logits;
    # dense's [B·N, V] float32 logits alone would be 20x one table here.
    table = 10_000_000 * 128 * 4
    assert 2 * table <= hbm[("cutbce", 10_000_000)] < 4 * table
    assert hbm[("cutbce", 100_003)] < hbm[("dense_bce", 100_003)]
    cpu = {(r["strategy"], r["vocab"]): r for r in payload["cpu"]}
    assert set(cpu) == {("dense_bce", 2_001), ("cutbce", 2_001)}
    for v in (2_001,):      # interleaved rows of one V compute one loss
        assert cpu[("cutbce", v)]["loss"] == pytest.approx(cpu[("dense_bce", v)]["loss"], rel=1e-5)
        assert cpu[("cutbce", v)]["repeats"] == 2 and cpu[("cutbce", v)]["median_s"] > 0
    import recloss
    assert payload["info"]["recloss_version"] == recloss.__version__
    assert png.stat().st_size > 10_000


@pytest.mark.tier2
def test_sampled_bias_mode_prints_writes_and_draws(tmp_path, capsys):
    """`recloss-bench --sampled-bias --quick`: every variant and K of the table, the JSON the docs
    render, the PNG; on this skewed state, keeping accidental hits brings the K = 1024 gradient
    closer to the exact one than removing them (for both proposals)."""
    from recloss.bench import sampled_bias
    out, png = tmp_path / "bias.json", tmp_path / "bias.png"
    assert cli.main(["--sampled-bias", "--quick", "--draws", "3", "--json", str(out), "--plot", str(png)]) == 0
    printed = capsys.readouterr().out
    data = json.loads(out.read_text())
    assert printed.strip() == sampled_bias.format_table(data)
    assert len(data["rows"]) == len(sampled_bias.VARIANTS) * len(sampled_bias.QUICK_KS)
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    at = {(r["proposal"], r["hits_removed"], r["num_negatives"]): r for r in data["rows"]}
    for proposal in ("uniform", "counts"):
        assert at[(proposal, False, 1024)]["cos_dE"] > at[(proposal, True, 1024)]["cos_dE"], at


class _FakeCompiled:
    """What `largest_vocab` reads of a compiled program: memory_analysis, with a table-sized cost."""

    def __init__(self, v):
        self.v = v

    def memory_analysis(self):
        import types
        return types.SimpleNamespace(argument_size_in_bytes=1000 * self.v, output_size_in_bytes=1000 * self.v,
                                     temp_size_in_bytes=7, alias_size_in_bytes=0)


@pytest.mark.tier1
@pytest.mark.parametrize("where", ["above the start", "below the start"])
def test_largest_vocab_brackets_the_refusal_to_the_tolerance(where, rng, monkeypatch):
    """The bisection, against a compiler that refuses every V past a drawn threshold."""
    from recloss.bench import topology

    lo = topology.LARGEST_VOCAB_START
    threshold = int(rng.integers(lo + 1, 300 * lo)) if where == "above the start" else int(rng.integers(128, lo))
    calls = []

    def compile_loss_grad(strategy, topo, shape, compiler_options):
        calls.append(shape.V)
        assert strategy == "cutbce" and topo == "v5e-8" and shape.D == 64 and shape.V > 0
        if shape.V > threshold:
            raise RuntimeError(f"RESOURCE_EXHAUSTED: Ran out of memory on HBM ({shape.V} rows)")
        module = Path(compiler_options["xla_dump_to"]) / "module_0001.jit_f.after_optimizations"
        Path(f"{module}-live-range.txt").write_text("HloLiveRange (max 1)\n")
        Path(f"{module}-memory-usage-report.txt").write_text(
            f"Memory Space: default (color=0)\nTotal bytes: {1500 * shape.V} (x GiB)\n\n"
            f"Memory Space: vmem (color=1)\nTotal bytes: 99\n")
        return _FakeCompiled(shape.V)

    monkeypatch.setattr(topology, "compile_loss_grad", compile_loss_grad)
    row = topology.largest_vocab("cutbce", "v5e-8", topology.Shape(2, 8, 64, 0), tolerance=0.01)
    print(f"threshold {threshold}: {row}")
    assert row["fits"] <= threshold < row["refused"]
    assert row["refused"] - row["fits"] <= max(128, 0.01 * row["fits"])
    assert row["fits"] % 128 == 0 and row["hbm_bytes"] == 2000 * row["fits"] + 7
    assert row["xla_hbm_bytes"] == 1500 * row["fits"]      # the dump's default memory space, not VMEM
    assert f"{row['fits']:,}" in topology.format_largest_vocab([row])
    assert row["compiles"] == len(calls) <= 40 and (row["B"], row["N"], row["D"]) == (2, 8, 64)


@pytest.mark.tier1
def test_largest_vocab_raises_what_is_not_out_of_memory(monkeypatch):
    from recloss.bench import topology

    def compile_loss_grad(strategy, topo, shape, compiler_options):
        raise ValueError("Mosaic failed to compile the kernel")

    monkeypatch.setattr(topology, "compile_loss_grad", compile_loss_grad)
    with pytest.raises(ValueError, match="Mosaic failed"):
        topology.largest_vocab("cutbce", "v5e-8", topology.Shape(2, 8, 64, 0))
    with pytest.raises(ValueError, match="tolerance must be in"):
        topology.largest_vocab("cutbce", "v5e-8", topology.Shape(2, 8, 64, 0), tolerance=0)
