"""recloss-bench on CPU: every row runs, computes the same loss, and reports what it measured.

Timings are not asserted (a shared machine varies 2x); the structure, the loss
agreement between rows and the deterministic compiled memory are.
"""

import json

import pytest

from recloss.bce import cut
from recloss.bench import cli

SMALL = ["--batch", "2", "--seq", "24", "--vocab", "3001", "--dim", "20", "--labels", "3", "--repeats", "2"]


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
    # block, so only "smaller" is asserted here (test_core_memory has the real bound).
    assert rows["dense_bce"]["temp_mib"] * 2**20 >= 2 * 24 * 3001 * 4
    assert rows["cutbce (fused)"]["temp_mib"] < rows["dense_bce"]["temp_mib"]
    assert payload["info"]["matmul_gflops_per_s"] > 0
    assert "| cutbce (fused) | 2×24 | 3,001 | 20 |" in text


def test_matmuls_only_patch_is_undone_on_error():
    real = cut.bernoulli_parts
    with pytest.raises(RuntimeError):
        with cli._identity_loss_math():
            assert cut.bernoulli_parts is not real
            raise RuntimeError("boom")
    assert cut.bernoulli_parts is real


@pytest.mark.parametrize("argv, message", [
    (["--strategies", "optax", "--topology", "v6e-8"], "--strategies optax is a CPU timing baseline"),
    (["--repeats", "0"], "--repeats must be >= 1, got 0"),
    (["--vocab", "-3"], "--vocab must be a positive int, got -3"),
])
def test_bad_arguments_name_the_value(argv, message, capsys):
    with pytest.raises(SystemExit):
        cli.main(argv)
    assert message in capsys.readouterr().err


def test_unknown_strategy_lists_the_known_ones():
    with pytest.raises(ValueError, match="cutbce"):
        cli.main(["--strategies", "cutbse"])


SOFTMAX_SMALL = ["--objective", "softmax", "--batch", "2", "--seq", "24", "--vocab", "3001", "--dim", "20",
                 "--repeats", "2"]


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


def test_softmax_peer_needs_the_softmax_objective(capsys):
    with pytest.raises(SystemExit):
        cli.main(["--strategies", "tokamax"])
    assert "--strategies tokamax is a softmax peer: use --objective softmax" in capsys.readouterr().err


def test_strategy_of_another_objective_is_named(capsys):
    with pytest.raises(SystemExit):
        cli.main(["--objective", "softmax", "--strategies", "cutbce"])
    assert "strategy 'cutbce' computes the 'bce' objective" in capsys.readouterr().err


def test_chunked_padding_bias_is_exp0_per_padded_column():
    """The offset `peers.padding_bias` predicts is log(e^Z + pad) − Z, exactly."""
    import numpy as np

    from recloss.bench import peers

    z = np.array([3.0, 7.5])
    bias, pad = peers.padding_bias(z, 3001, v_block=2048)
    assert pad == 1095
    assert bias == pytest.approx(np.mean(np.log(np.exp(z) + pad) - z), rel=1e-6)
