"""recloss for existing Flax trainers: output heads (NNX and linen) and a config-driven loss function.

    from recloss_plugins.flax import MultiLabelHead        # Flax NNX
    from recloss_plugins.flax.linen import MultiLabelHead  # Flax linen
    from recloss_plugins.flax import make_loss_fn          # fn(hidden, table, targets, weights) -> (loss, metrics)

`unwrap` gives the array inside an nnx.Variable or a linen boxed param.
"""

from recloss_plugins.flax import linen, nnx
from recloss_plugins.flax._common import unwrap
from recloss_plugins.flax.loss_fn import config_to_dict, make_loss_fn, resolve_config
from recloss_plugins.flax.linen import MultiLabelHead as LinenMultiLabelHead
from recloss_plugins.flax.nnx import MultiLabelHead

# The submodules `nnx` and `linen` stay out of __all__: a star import would
# shadow `flax.nnx` / `flax.linen` in the importer's namespace.

__all__ = [
    "LinenMultiLabelHead",
    "MultiLabelHead",
    "config_to_dict",
    "make_loss_fn",
    "resolve_config",
    "unwrap",
]
