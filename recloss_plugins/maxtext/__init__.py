"""recloss in MaxText: config keys (``loss=cutbce_pallas`` ...) and the training loss.

    from maxtext.configs import pyconfig
    from maxtext.trainers.pre_train import train
    from recloss_plugins import maxtext as rm

    rm.install(train)                       # train.loss_fn -> recloss
    config = pyconfig.initialize(["", "base.yml", "loss=cutce_pallas", "num_vocab_tiling=2"],
                                 config_class=rm.config_class())

``loss=cutce`` / ``loss=cutce_pallas`` compute MaxText's own token cross-entropy
(softmax over the vocabulary, z_loss_multiplier included) without [tokens, vocab]
logits; ``loss=cutbce`` / ``cutbce_pallas`` train with full-vocabulary BCE.

MaxText is imported lazily (only by `config_class`, `loss_fn` and `install`):
importing this package does not need it. MaxText needs Python >= 3.12; the
``maxtext`` extra of recloss installs it there.
"""

from recloss_plugins.maxtext.config import (
    FIELDS,
    OPTION_KEYS,
    check_supported,
    config_class,
    derive_mesh_axes,
    layout_for,
    loss_settings,
    maxtext_soft_cap,
    pick_num_vocab_tiling,
)
from recloss_plugins.maxtext.loss import (
    install,
    installed,
    loss_fn,
    loss_from_hidden,
    output_table,
    uninstall,
    vocab_loss,
)

__all__ = [
    "FIELDS",
    "OPTION_KEYS",
    "check_supported",
    "config_class",
    "derive_mesh_axes",
    "install",
    "installed",
    "layout_for",
    "loss_fn",
    "loss_from_hidden",
    "loss_settings",
    "maxtext_soft_cap",
    "output_table",
    "pick_num_vocab_tiling",
    "uninstall",
    "vocab_loss",
]
