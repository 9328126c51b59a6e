"""MaxText pre-training with the recloss loss.

    python -m recloss_plugins.maxtext.train path/to/base.yml loss=cutce_pallas num_vocab_tiling=2 ...

Runs ``maxtext.trainers.pre_train.train.main`` with `install` applied (its
``loss_fn`` is the recloss one) and with `config_class` as the config type, so
the recloss keys are accepted and checked before any work runs.
"""

from __future__ import annotations

import contextlib
from typing import Sequence

from recloss_plugins.maxtext.config import config_class
from recloss_plugins.maxtext.loss import installed


@contextlib.contextmanager
def recloss_config_default():
    """Within the block, ``pyconfig.initialize`` defaults to ``config_class=config_class()``."""
    from maxtext.configs import pyconfig

    original = pyconfig.initialize
    cls = config_class()

    def initialize(argv=None, config_class=cls, **kwargs):  # noqa: D401 - same contract as MaxText's
        return original(argv, config_class=config_class, **kwargs)

    pyconfig.initialize = initialize
    try:
        yield
    finally:
        pyconfig.initialize = original


def main(argv: Sequence[str]) -> None:
    """MaxText's ``train.main(argv)`` with the recloss loss and config keys."""
    with installed() as train, recloss_config_default():
        train.main(argv)


if __name__ == "__main__":
    from absl import app

    app.run(main)
