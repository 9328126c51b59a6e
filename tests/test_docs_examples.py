"""The guides' examples run as printed and do what they say: docs/flax.md's model trains,
docs/sharding.md's sharded loss and hand-written data-parallel step equal one device.

The first Flax block and both sharding blocks are executed verbatim (the sharding ones on the 8 CPU
devices of conftest); tests/test_docs.py runs every page's other Python blocks.
"""

import contextlib
import io
import pathlib

import pytest

from helpers import python_blocks

pytestmark = pytest.mark.tier2

ROOT = pathlib.Path(__file__).resolve().parents[1]
FLAX_PAGE = ROOT / "docs" / "flax.md"
SHARDING_PAGE = ROOT / "docs" / "sharding.md"


def test_flax_example_runs_and_learns():
    path = FLAX_PAGE
    blocks = python_blocks(path.read_text(encoding="utf-8"))
    assert blocks, f"no ```python block in {path}"
    namespace = {"__name__": "readme_example"}
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        exec(compile(blocks[0], f"{path.name}:block 1", "exec"), namespace)  # noqa: S102
    losses = namespace["losses"]
    assert len(losses) >= 2 and all(v == v for v in losses), losses  # no NaN
    assert losses[-1] < 0.1 * losses[0], f"example loss did not fall: {losses[0]} -> {losses[-1]}"
    metrics = namespace["metrics"]
    recall = float(metrics["tp"] / (metrics["tp"] + metrics["fn"]))
    assert recall > 0.5, f"example model did not learn its targets: recall {recall}"
    assert "loss" in out.getvalue()



def test_sharding_example_runs_and_equals_one_device():
    """docs/sharding.md's first block as printed (a jax.make_mesh mesh, plain arrays, a padded table with
    vocab_size=V): its loss and gradients equal the single-device loss of the same arrays."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    import recloss

    path = SHARDING_PAGE
    blocks = python_blocks(path.read_text(encoding="utf-8"))
    assert blocks, f"no ```python block in {path}"
    ns = {"__name__": "readme_sharding_example"}
    exec(compile(blocks[0], f"{path.name}:block 1", "exec"), ns)  # noqa: S102
    layout, v = ns["layout"], ns["V"]
    assert ns["table"].shape[0] == recloss.padded_vocab_size(v, layout) >= v
    assert int(jnp.max(ns["targets"])) < v

    def one_device(hidden, table):
        return recloss.bce_loss(hidden, table, ns["targets"], ns["weights"], strategy="cutbce",
                                vocab_size=v).loss

    ref, (ref_dh, ref_de) = jax.jit(jax.value_and_grad(one_device, argnums=(0, 1)))(ns["hidden"], ns["table"])
    rel = lambda a, b: float(np.linalg.norm(np.asarray(a, np.float64) - np.asarray(b, np.float64))
                             / np.linalg.norm(np.asarray(b, np.float64)))
    assert rel(ns["loss"], ref) <= 1e-5, (float(ns["loss"]), float(ref))
    assert rel(ns["d_hidden"], ref_dh) <= 1e-4
    assert rel(ns["d_table"], ref_de) <= 1e-4
    assert float(np.max(np.abs(np.asarray(ns["d_table"])[v:]))) == 0.0     # padding rows inert
    assert isinstance(ns["specs"], recloss.Specs)
    # The data-parallel step written by hand (MeshLayout(manual=True) and psum_in_place).
    assert len(blocks) >= 2, f"no second ```python block (the hand-written data-parallel step) in {path}"
    exec(compile(blocks[1], f"{path.name}:block 2 (manual)", "exec"), ns)  # noqa: S102
    assert ns["manual"].manual
    assert rel(ns["dp_loss"], ref) <= 1e-5, (float(ns["dp_loss"]), float(ref))
    assert rel(ns["dp_d_table"], ref_de) <= 1e-4
