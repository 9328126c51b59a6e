"""Tokamax's `linear_softmax_cross_entropy_loss` as a peer of the softmax rows (optional).

Tokamax is not a dependency (``pip install recloss[bench]``); without it the
rows are skipped with the reason. Its implementations differ by release:
0.0.12 (the last for Python 3.11) has 'xla' (dense logits, recomputed in a custom
VJP) and 'mosaic_tpu'; 0.0.13+ adds 'chunked_xla' (blocked over batch and vocab).
Only public names are used: implementations are found by asking the API for
each one (an unknown name is a ValueError).

Tokamax takes one label per position (labels [B]) and the table as [D, V]
(``weights``); `loss_fn` gives it the table in that layout, so no row pays for a
transpose another does not.
"""

from __future__ import annotations

import contextlib
from typing import Optional, Tuple

PREFIX = "tokamax"
KNOWN = ("xla", "chunked_xla", "mosaic_tpu")
CPU_IMPLEMENTATIONS = ("xla", "chunked_xla")     # mosaic_tpu is a TPU kernel
# chunked_xla pads the table's V to a multiple of its v_block_size (tokamax's Config default, 2048)
# with zero columns, which enter the log-partition as exp(0) each (see `padding_bias`).
CHUNKED_V_BLOCK = 2048


def version() -> Optional[str]:
    try:
        from importlib.metadata import version as _v
        return _v("tokamax")
    except Exception:   # not installed, or installed without metadata
        return None


def import_error() -> Optional[str]:
    """None when ``import tokamax`` works, else why not (one line)."""
    try:
        import tokamax  # noqa: F401
    except Exception as err:   # ImportError, or a jax it does not support
        return f"import tokamax failed ({type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''}); " \
               "pip install 'recloss[bench]'"
    return None


def _absl_flags_parsed():
    """Tokamax 0.0.12 reads its config through absl flags, parsing all of ``sys.argv`` on first use
    (recloss-bench's own --batch then raises UnrecognizedFlagError; 0.0.13+ parses only its own).
    Parsing just the program name first leaves every absl flag at its default."""
    import sys
    from absl import flags

    if not flags.FLAGS.is_parsed():
        flags.FLAGS(sys.argv[:1], known_only=True)


def implementations(wanted=KNOWN) -> Tuple[str, ...]:
    """Which of ``wanted`` this Tokamax has (traced on tiny shapes, nothing compiled)."""
    import jax
    import jax.numpy as jnp
    import tokamax

    _absl_flags_parsed()
    x = jax.ShapeDtypeStruct((8, 128), jnp.float32)
    w = jax.ShapeDtypeStruct((128, 256), jnp.float32)
    t = jax.ShapeDtypeStruct((8,), jnp.int32)
    have = []
    for impl in wanted:
        try:
            with cross_compile():
                jax.eval_shape(lambda x, t, w: tokamax.linear_softmax_cross_entropy_loss(
                    x, t, w, reduction="mean", implementation=impl), x, t, w)
        except ValueError as err:
            if "Unsupported implementation" in str(err):
                continue       # this release does not have it
        except Exception:      # it exists; whatever failed will fail again where it is used, visibly
            pass
        have.append(impl)
    return tuple(have)


@contextlib.contextmanager
def cross_compile():
    """Tokamax's own switch for compiling kernels for a device that is not attached (AOT)."""
    import tokamax
    cfg = getattr(getattr(tokamax, "config", None), "cross_compile", None)
    with (cfg(True) if cfg is not None else contextlib.nullcontext()):
        yield


def loss_fn(impl: str):
    """``loss(hidden [M, D], weights [D, V], labels [M]) -> mean CE`` through Tokamax's ``impl``."""
    import tokamax

    _absl_flags_parsed()

    def loss(hidden, weights, labels):
        return tokamax.linear_softmax_cross_entropy_loss(hidden, labels, weights, reduction="mean",
                                                         implementation=impl)
    return loss


def padding_bias(lse, vocab: int, v_block: int = CHUNKED_V_BLOCK):
    """What chunked_xla's zero-padded columns add to the mean loss: mean_r log(1 + pad·e^(−Z_r)).

    ``lse`` [M]: the exact per-row log-partition Z. pad = −V mod v_block columns of
    logit 0 each add exp(0) = 1 to Σ exp(x), so its Z is log(e^Z + pad).
    """
    import jax.numpy as jnp

    pad = -vocab % v_block
    return float(jnp.mean(jnp.log1p(pad * jnp.exp(-lse)))), pad
