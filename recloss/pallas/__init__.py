"""Pallas strategies. Importing this module registers ``cutbce_pallas``.

``cutbce_pallas`` is `recloss.registry.CutBCE` (same sparse target correction,
same metrics) with the dense background computed by the Mosaic-TPU kernel in
`recloss.pallas.tpu`. It runs on TPU; on CPU only in Pallas interpret mode (for
tests); on GPU use ``cutbce``.
"""

from __future__ import annotations

import threading
import warnings
from typing import Any, Optional

from recloss.options import LossOptions
from recloss.pallas import tiling
from recloss.registry import CutBCE, register_strategy

_warned = False
_warn_lock = threading.Lock()


def _warn_interpret_once():
    global _warned
    with _warn_lock:
        if _warned:
            return
        _warned = True
    warnings.warn("strategy 'cutbce_pallas' is running its Pallas kernel in interpret mode "
                  "(slow; meant for testing on CPU). On TPU it compiles with Mosaic; elsewhere "
                  "use strategy='cutbce'.", RuntimeWarning, stacklevel=3)


class CutBCEPallas(CutBCE):
    """CutBCE with the background as one fused Pallas (Mosaic-TPU) sweep.

    Memory O(bn·D + bv·D) VMEM per core and O(V·D) HBM for dE; 6·M·V·D flops
    for loss+grad of a scalar loss (loss-only: 2·M·V·D; reduction='none'
    backward recomputes with 4·M·V·D).

    Args:
      options: LossOptions (``block_n``/``block_v`` map to the kernel's row tile
        and vocab block; ``interpret`` None = interpret off TPU).
      chip: tile for this chip ('v4', 'v5e', 'v5p', 'v6e', 'v7') instead of the
        detected one; a two-core chip also selects the split vocab grid.
      interpret_params: a ``pltpu.InterpretParams`` used whenever the kernel
        runs in interpret mode (e.g. ``detect_races=True``).
    """

    name = "cutbce_pallas"
    platforms = ("cpu", "tpu")

    def __init__(self, options: LossOptions, *, chip: Optional[str] = None, interpret_params: Any = None):
        super().__init__(options)
        if chip is not None:
            tiling.get_chip(chip)          # validates the name
        self.chip = chip
        self.interpret_params = interpret_params

    def check_platform(self, platform: str):
        if platform == "gpu":
            raise ValueError("strategy 'cutbce_pallas' is a Mosaic-TPU Pallas kernel and does not run on "
                             "platform 'gpu'; use strategy='cutbce' (blocked pure JAX, same math and "
                             "fused gradient) instead")
        super().check_platform(platform)

    def interpret(self, platform: str) -> bool:
        """Whether the kernel runs in Pallas interpret mode on ``platform``."""
        if self.options.interpret is not None:
            return self.options.interpret
        return platform != "tpu"

    def background(self, hidden, table, bias, row_scale, vocab_offset, *, vocab_size, scalar, platform):
        """Same contract as `CutBCE.background`: (Σ r·bg or bg rows [M], predicted counts [M] or None)."""
        self.check_platform(platform)
        if hidden.shape[0] == 0:
            return super().background(hidden, table, bias, row_scale, vocab_offset,
                                      vocab_size=vocab_size, scalar=scalar, platform=platform)
        import jax.numpy as jnp
        from recloss.pallas import tpu

        interpret = self.interpret(platform)
        if interpret and platform != "tpu":
            _warn_interpret_once()
        mode = (self.interpret_params or True) if interpret else False
        static = vocab_offset if isinstance(vocab_offset, int) else None
        plan = tpu.Plan(self.options, int(vocab_size), static, tiling.get_chip(self.chip), mode)
        offset = jnp.asarray(vocab_offset, jnp.int32)
        if scalar:
            return tpu.background_total(hidden, table, bias, row_scale, offset, plan)
        return tpu.background_rows(hidden, table, bias, offset, plan)


register_strategy("cutbce_pallas", CutBCEPallas)

__all__ = ["CutBCEPallas"]
