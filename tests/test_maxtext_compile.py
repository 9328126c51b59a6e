"""`recloss-maxtext-compile`: MaxText's own train_compile for a TPU topology, with and without the
recloss loss, printing the per-chip HBM as MaxText counts it (real MaxText: the Python 3.12 leg)."""

from __future__ import annotations

import os
import pathlib
import re
import subprocess
import sys

import pytest

from recloss_plugins.maxtext import compile as mc

pytestmark = pytest.mark.tpu_aot
ROOT = pathlib.Path(__file__).resolve().parents[1]

TINY = ["run_name=recloss_compile", "enable_checkpointing=false", "base_emb_dim=128", "base_num_query_heads=2",
        "base_num_kv_heads=2", "head_dim=64", "base_mlp_dim=256", "base_num_decoder_layers=1",
        "vocab_size=1024", "max_target_length=128", "per_device_batch_size=1", "dtype=float32",
        "attention=dot_product", "log_config=false", "skip_jax_distributed_system=true",
        "compile_topology=v6e-8", "compile_topology_num_slices=1"]


@pytest.mark.tier1
def test_loss_argument_is_the_last_loss_key():
    assert mc.loss_argument(["prog", "base.yml", "steps=2"]) is None
    assert mc.loss_argument(["prog", "base.yml", "loss=cutce", "loss=cutce_pallas"]) == "cutce_pallas"
    m = mc.Measured({"total": 3 * 2**30, "temp": 2**30}, 12.34, None)
    assert mc.describe(m) == ("recloss-maxtext-compile: per-chip HBM 3.000 GiB (temporaries 1.000 GiB), "
                              "compiled in 12.3 s; loss=MaxText default")
    assert mc.describe(m._replace(xla_bytes=5 * 2**29, loss="cutce_pallas")) == (
        "recloss-maxtext-compile: per-chip HBM 3.000 GiB (temporaries 1.000 GiB; XLA's count 2.500 GiB), "
        "compiled in 12.3 s; loss=cutce_pallas")


@pytest.mark.tier1
def test_xla_count_reads_the_dump_xla_flags_names(tmp_path):
    assert mc.xla_count("--xla_force_host_platform_device_count=8") is None
    with pytest.raises(RuntimeError, match=r"asks for a dump into .* but XLA wrote no buffer assignment"):
        mc.xla_count(f"--xla_dump_to={tmp_path}")
    stem = tmp_path / "module_0001.jit_train_step.after_optimizations"
    (tmp_path / (stem.name + "-live-range.txt")).write_text("x")
    (tmp_path / (stem.name + "-memory-usage-report.txt")).write_text(
        "Memory Space: default (color=0)\nTotal bytes: 1234567\n")
    assert mc.xla_count(f"--xla_foo=1 --xla_dump_to={tmp_path} --xla_bar=2") == 1234567


@pytest.fixture(scope="module")
def base_yml():
    if os.environ.get("RECLOSS_REQUIRE_MAXTEXT") != "1":
        pytest.importorskip("maxtext.trainers.pre_train.train_compile",
                            reason="MaxText is not installed (Python >= 3.12: pip install 'recloss[maxtext]')")
    pytest.importorskip("libtpu", reason="libtpu is not importable: no TPU AOT compiler")
    from maxtext.utils.globals import MAXTEXT_CONFIGS_DIR

    return os.path.join(MAXTEXT_CONFIGS_DIR, "base.yml")


def _process(*args):
    """The command in a fresh process: MaxText's train_compile leaves process-wide state behind
    (PRNG implementation, compilation cache, Flax's sharding context) that other tests must not see."""
    env = dict(os.environ, JAX_PLATFORMS="cpu", TPU_SKIP_MDS_QUERY="1")
    return subprocess.run([sys.executable, "-m", "recloss_plugins.maxtext.compile", *args], capture_output=True,
                          text=True, env=env, timeout=600, cwd=ROOT)


def _run(*args):
    run = _process(*args)
    assert run.returncode == 0, run.stderr[-4000:]
    lines = [l for l in run.stdout.splitlines() if l.startswith("recloss-maxtext-compile:")]
    assert len(lines) == 1, run.stdout[-4000:]
    return lines[0], run.stderr


@pytest.mark.tier2
def test_compiles_maxtext_with_and_without_the_recloss_loss(base_yml):
    """Plain MaxText, then the recloss loss (whose loss_fn raises if MaxText's step never called its
    hook, so a 0 exit means the recloss loss was compiled into the step)."""
    plain, _ = _run(base_yml, *TINY)
    ours, err = _run(base_yml, *TINY, "loss=cutce_pallas", "num_vocab_tiling=2", "loss_batch_axes=[data,fsdp]",
                     "loss_fsdp_axis=fsdp")
    # The Mosaic kernel was compiled, not its interpret-mode stand-in (the host's backend is the CPU).
    assert "interpret mode" not in err, err[-2000:]
    pattern = r"recloss-maxtext-compile: per-chip HBM (\d+\.\d{3}) GiB \(temporaries (\d+\.\d{3}) GiB\), " \
              r"compiled in (\d+\.\d) s; loss=(.+)$"
    for line, loss in ((plain, "MaxText default"), (ours, "cutce_pallas")):
        m = re.match(pattern, line)
        assert m and m.group(4) == loss, line
        assert float(m.group(1)) >= float(m.group(2)) > 0 and float(m.group(3)) > 0, line
    assert "unexpected worker hostname" not in err, err[-2000:]


@pytest.mark.tier2
def test_a_pallas_loss_alone_reads_its_axes_from_maxtext_mesh(base_yml):
    """``loss=cutce_pallas`` with no mesh keys: the shard_map's axes come from MaxText's mesh and rules
    (v6e-8's default mesh is fsdp 8) and 'auto' picks the gather, both printed; the step compiles."""
    run = _process(base_yml, *TINY, "loss=cutce_pallas", "num_vocab_tiling=2")
    assert run.returncode == 0, run.stderr[-4000:]
    out = run.stdout + run.stderr
    assert ("recloss: loss='cutce_pallas' runs a Mosaic kernel under shard_map on MaxText's 8-device mesh: "
            "loss_batch_axes=['fsdp'], loss_fsdp_axis=fsdp, loss_vocab_axis=None") in out, out[-3000:]
    # fsdp 8, 128 rows of the 1,024-row table a slice, 128 tokens a chip: 8·128 > 2·128, so the ring.
    assert "recloss: loss_fsdp_gather=auto: 'ring' (fsdp 8, 128 table rows a slice, 128 positions a chip" in out
    assert "interpret mode" not in run.stderr
