"""`recloss-maxtext-compile`: MaxText's own train_compile for a TPU topology, with and without the
recloss loss, printing the per-chip HBM as MaxText counts it (real MaxText: the Python 3.12 leg)."""

from __future__ import annotations

import io
import os

import pytest

from recloss_plugins.maxtext import compile as mc
from recloss_plugins.maxtext import loss as rm_loss

pytestmark = pytest.mark.tpu_aot

TINY = ["run_name=recloss_compile", "enable_checkpointing=false", "base_emb_dim=128", "base_num_query_heads=2",
        "base_num_kv_heads=2", "head_dim=64", "base_mlp_dim=256", "base_num_decoder_layers=1",
        "vocab_size=1024", "max_target_length=128", "per_device_batch_size=1", "dtype=float32",
        "attention=dot_product", "log_config=false", "skip_jax_distributed_system=true",
        "compile_topology=v6e-8", "compile_topology_num_slices=1"]


def test_loss_argument_is_the_last_loss_key():
    assert mc.loss_argument(["prog", "base.yml", "steps=2"]) is None
    assert mc.loss_argument(["prog", "base.yml", "loss=cutce", "loss=cutce_pallas"]) == "cutce_pallas"
    m = mc.Measured({"total": 3 * 2**30, "temp": 2**30}, 12.34, None)
    assert mc.describe(m) == ("recloss-maxtext-compile: per-chip HBM 3.000 GiB (temporaries 1.000 GiB), "
                              "compiled in 12.3 s; loss=MaxText default")


@pytest.fixture(scope="module")
def base_yml():
    if os.environ.get("RECLOSS_REQUIRE_MAXTEXT") != "1":
        pytest.importorskip("maxtext.trainers.pre_train.train_compile",
                            reason="MaxText is not installed (Python >= 3.12: pip install 'recloss[maxtext]')")
    pytest.importorskip("libtpu", reason="libtpu is not importable: no TPU AOT compiler")
    from recloss.bench.topology import libtpu_aot_env
    from maxtext.utils.globals import MAXTEXT_CONFIGS_DIR

    libtpu_aot_env()
    return os.path.join(MAXTEXT_CONFIGS_DIR, "base.yml")


@pytest.mark.slow
def test_compiles_maxtext_with_and_without_the_recloss_loss(base_yml, monkeypatch):
    calls = []
    real = rm_loss.vocab_loss

    def counting(*args, **kwargs):
        calls.append(args[3].loss)
        return real(*args, **kwargs)

    monkeypatch.setattr(rm_loss, "vocab_loss", counting)
    train = pytest.importorskip("maxtext.trainers.pre_train.train")
    original = train.loss_fn
    out = io.StringIO()
    plain = mc.compile_step(["prog", base_yml, *TINY], out=out)
    assert not calls and plain.loss is None
    ours = mc.compile_step(["prog", base_yml, *TINY, "loss=cutce_pallas", "num_vocab_tiling=2"], out=out)
    assert calls and set(calls) == {"cutce_pallas"}      # traced in MaxText's own train step
    assert train.loss_fn is original                      # uninstalled after
    for m in (plain, ours):
        rep = m.memory
        assert rep["total"] == rep["argument"] + rep["output"] + rep["temp"] - rep["alias"] > 0
        assert m.seconds > 0
    lines = out.getvalue().splitlines()
    assert len(lines) == 2 and lines[0].endswith("loss=MaxText default") and lines[1].endswith("loss=cutce_pallas")
