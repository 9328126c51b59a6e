"""MaxText's ahead-of-time compile of its train step, with the recloss loss when one is asked for.

    python -m recloss_plugins.maxtext.compile path/to/base.yml compile_topology=v6e-8 \\
        model_name=qwen3-0.6b per_device_batch_size=4 max_target_length=2048 \\
        loss=cutce_pallas num_vocab_tiling=2
    recloss-maxtext-compile ...                              # the same, as a console script

Runs MaxText's own ``maxtext.trainers.pre_train.train_compile.main``. With a ``loss=`` argument the
recloss loss is installed and the recloss config keys are accepted (as `recloss_plugins.maxtext.train`
does); without one it is plain MaxText, so one command measures both sides. After MaxText's output it
prints the compiled step's per-chip HBM as MaxText counts it (arguments + outputs + temporaries −
aliased), the temporaries alone and the compile's wall time:

    recloss-maxtext-compile: per-chip HBM 5.214 GiB (temporaries 2.118 GiB), compiled in 41.3 s; loss=cutce_pallas

and returns them (`Measured`). When ``XLA_FLAGS`` has ``--xla_dump_to=DIR`` the line also carries XLA's own
count of the step's HBM (`recloss.aot.hbm_bytes`: what the TPU compiler holds against the chip), read from
the buffer assignment it dumped: ``per-chip HBM 5.214 GiB (temporaries 2.118 GiB; XLA's count 4.987 GiB)``.
A step that does not fit stops with MaxText's (XLA's) out-of-memory error.
"""

from __future__ import annotations

import contextlib
import os
import re
import sys
import time
from typing import Dict, NamedTuple, Optional, Sequence

from recloss.aot import hbm_bytes, libtpu_env, memory_report

_MODULE = "maxtext.trainers.pre_train.train_compile"
_PREFIX = "recloss-maxtext-compile:"


class Measured(NamedTuple):
    """What one compile cost: ``memory`` is `recloss.aot.memory_report`'s dict (bytes per
    chip: argument, output, temp, alias, code, total); ``seconds`` the compile's wall time; ``loss``
    the recloss strategy, or None for MaxText's own loss; ``xla_bytes`` XLA's own count (`xla_count`),
    or None when no dump was asked for."""
    memory: Dict[str, float]
    seconds: float
    loss: Optional[str]
    xla_bytes: Optional[int] = None


_DUMP = re.compile(r"--xla_dump_to=(\S+)")


def xla_count(flags: Optional[str] = None) -> Optional[int]:
    """XLA's own HBM count of the step (`recloss.aot.hbm_bytes`) from the folder ``--xla_dump_to`` in
    ``flags`` (default: the ``XLA_FLAGS`` environment variable) names, or None when it names none.
    Raises RuntimeError when the folder holds no buffer assignment to read."""
    m = _DUMP.search(os.environ.get("XLA_FLAGS", "") if flags is None else flags)
    if not m:
        return None
    try:
        count = hbm_bytes(m.group(1))
    except FileNotFoundError as err:
        raise RuntimeError(f"XLA_FLAGS asks for a dump into {m.group(1)!r}, but XLA wrote no buffer assignment "
                           f"there: {err}") from None
    if count < 0:
        raise RuntimeError(f"XLA wrote no memory-usage report into {m.group(1)!r}; its own HBM count is unknown")
    return count


def loss_argument(argv: Sequence[str]) -> Optional[str]:
    """The value of the last ``loss=`` argument of a MaxText command line, or None."""
    found = None
    for arg in argv[1:]:
        if arg.startswith("loss="):
            found = arg.split("=", 1)[1]
    return found


@contextlib.contextmanager
def _timed_compile(module, record: list):
    """``module.jit_and_compile`` wrapped for the block: each call's compiled step and wall time are
    appended to ``record``."""
    original = module.jit_and_compile

    def jit_and_compile(*args, **kwargs):
        start = time.perf_counter()
        compiled = original(*args, **kwargs)
        record.append((compiled, time.perf_counter() - start))
        return compiled

    module.jit_and_compile = jit_and_compile
    try:
        yield
    finally:
        module.jit_and_compile = original


def compile_step(argv: Sequence[str], *, out=None) -> Measured:
    """MaxText's ``train_compile.main(argv)`` (argv[0] is the program name, as absl passes it), with
    the recloss loss installed when argv has ``loss=``; prints and returns the step's `Measured`."""
    import importlib

    libtpu_env()   # off a TPU VM: name this host the only worker (no libtpu noise, nothing probed)
    module = importlib.import_module(_MODULE)
    loss = loss_argument(argv)
    record: list = []
    with contextlib.ExitStack() as stack:
        if loss is not None:
            from recloss_plugins.maxtext.loss import installed
            from recloss_plugins.maxtext.train import recloss_config_default

            stack.enter_context(installed())
            stack.enter_context(recloss_config_default())
        stack.enter_context(_timed_compile(module, record))
        module.main(list(argv))
    if not record:
        raise RuntimeError(f"{_MODULE}.main returned without calling jit_and_compile: this MaxText "
                           f"version compiles its step elsewhere, so nothing was measured")
    compiled, seconds = record[-1]
    measured = Measured(memory_report(compiled), seconds, loss, xla_count())
    print(describe(measured), file=out or sys.stdout, flush=True)
    return measured


def describe(m: Measured) -> str:
    """`Measured` as the one line the command prints."""
    g = lambda key: f"{m.memory[key] / 2**30:.3f} GiB"
    xla = "" if m.xla_bytes is None else f"; XLA's count {m.xla_bytes / 2**30:.3f} GiB"
    hbm = (f"per-chip HBM {g('total')} (temporaries {g('temp')}{xla})" if m.memory
           else "per-chip HBM unavailable (no memory analysis on this backend)")
    return f"{_PREFIX} {hbm}, compiled in {m.seconds:.1f} s; loss={m.loss or 'MaxText default'}"


def main(argv: Optional[Sequence[str]] = None) -> None:
    """Console entry point: ``recloss-maxtext-compile BASE_YML KEY=VALUE ...``."""
    from absl import app

    def run(args):
        compile_step(args)   # absl exits with main's return value: None is success

    app.run(run, argv=[sys.argv[0], *(sys.argv[1:] if argv is None else argv)])


if __name__ == "__main__":
    main()
