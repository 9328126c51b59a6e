"""What the Pallas strategies (`cutbce_pallas`, `cutce_pallas`) share: the chip and interpret-mode
options, the platform check (GPU is an error naming the pure-JAX strategy of the same math), and the
one-time warning when a kernel runs in interpret mode.

`PallasStrategy` is a mixin placed before the objective's blocked strategy:

    class CutCEPallas(PallasStrategy, CutCE):
        name, fallback = "cutce_pallas", "cutce"
        kernel_sweeps = kernel.SWEEPS

Its `plan` runs ``kernel_sweeps`` (the objective's kernel, a `recloss.sweep.Sweeps`) instead of the
blocked strategy's pure-JAX sweep, except with no rows, where a kernel grid has nothing to walk.
"""

from __future__ import annotations

import threading
import warnings
from typing import Any, Optional

from recloss import sweep
from recloss.options import LossOptions
from recloss.pallas import tiling

_warned: set = set()          # names of the strategies that have warned
_warn_lock = threading.Lock()


def warn_interpret_once(name: str, fallback: str, stacklevel: int = 3):
    """A RuntimeWarning, once per process and strategy, that ``name`` runs its kernel in interpret mode."""
    with _warn_lock:
        if name in _warned:
            return
        _warned.add(name)
    warnings.warn(f"strategy {name!r} is running its Pallas kernel in interpret mode "
                  f"(slow; meant for testing on CPU). On TPU it compiles with Mosaic; elsewhere "
                  f"use strategy={fallback!r}.", RuntimeWarning, stacklevel=stacklevel + 1)


class PallasStrategy:
    """Mixin of a Strategy whose plan runs a Mosaic-TPU Pallas kernel. ``chip`` and
    ``interpret_params`` also reach it through `recloss.get_strategy` and the entry points.

    Runs on TPU; on CPU only in Pallas interpret mode (for tests, with a
    one-time RuntimeWarning); on GPU it is an error naming ``fallback``.

    Args:
      options: LossOptions (``interpret`` None = interpret off TPU).
      chip: tile for this chip ('v4', 'v5e', 'v5p', 'v6e', 'v7') instead of the
        detected one; a two-core chip also selects the split vocab grid.
      interpret_params: a ``pltpu.InterpretParams`` used whenever the kernel
        runs in interpret mode (e.g. ``detect_races=True``).
    """

    platforms = ("cpu", "tpu")
    fallback: str = ""           # the pure-JAX strategy of the same math
    fallback_note: str = "blocked pure JAX, same math"
    kernel_sweeps = None         # the objective's kernel `recloss.sweep.Sweeps`

    def __init__(self, options: LossOptions, *, chip: Optional[str] = None, interpret_params: Any = None):
        super().__init__(options)
        if chip is not None:
            tiling.get_chip(chip)          # validates the name
        self.chip = chip
        self.interpret_params = interpret_params

    def check_platform(self, platform: str):
        if platform == "gpu":
            raise ValueError(f"strategy {self.name!r} is a Mosaic-TPU Pallas kernel and does not run on "
                             f"platform 'gpu'; use strategy={self.fallback!r} ({self.fallback_note}) "
                             f"instead")
        super().check_platform(platform)

    def interpret(self, platform: str) -> bool:
        """Whether the kernel runs in Pallas interpret mode on ``platform``."""
        if self.options.interpret is not None:
            return self.options.interpret
        return platform != "tpu"

    def xla_partitions(self, platform: str) -> bool:
        """Only in interpret mode: XLA cannot partition a Mosaic kernel (it needs a `MeshLayout`)."""
        return self.interpret(platform)

    def grad_partials(self, layout) -> int:
        """dA partials the kernel keeps per row on ``layout``'s chips: one per TensorCore that splits
        the vocab blocks (2 on v4 and v5p), 1 in interpret mode."""
        if self.interpret(layout.platform):
            return 1
        if self.chip is not None:
            return tiling.get_chip(self.chip).cores
        device = layout.mesh.devices.flat[0]
        return tiling.chip_from_device_kind(device.device_kind, getattr(device, "num_cores", None)).cores

    def kernel_config(self, platform: str):
        """(chip, interpret) for a kernel plan on ``platform``: the `tiling.Chip` to tile for, and
        False, True or the ``interpret_params``. Warns once when the kernel is interpreted off TPU."""
        interpret = self.interpret(platform)
        if interpret and platform != "tpu":
            warn_interpret_once(self.name, self.fallback, stacklevel=4)
        mode = (self.interpret_params or True) if interpret else False
        return tiling.get_chip(self.chip), mode

    def plan(self, m: int, shard) -> sweep.Plan:
        """The kernel plan for M rows on ``shard`` (`recloss.shard.VocabShard`); with no rows the
        blocked strategy's pure-JAX plan, which gives the empty sums."""
        if m == 0:
            return super().plan(m, shard)
        chip, mode = self.kernel_config(shard.platform)
        return shard.planned(sweep.Plan(self.kernel_sweeps, self.combine, self.options,
                                        int(shard.vocab_size), shard.static_offset, chip=chip,
                                        interpret=mode, owner=self.name, sparse=self.sparse_term))
