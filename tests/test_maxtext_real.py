"""The Python 3.12 leg really runs against MaxText: it imports, and its hooks are where the plugin expects.

`make test-py312` sets RECLOSS_REQUIRE_MAXTEXT=1: then a MaxText that does not import is a
failure, not a skip (without it, on Python 3.11, these tests skip and say why). The
real-MaxText tests of the plugin itself (pyconfig with `config_class()`, loss and every
gradient against MaxText's own, a few steps of its training loop) are in test_maxtext.py.
"""

import importlib
import inspect
import os

import pytest

from recloss_plugins import maxtext as rm
from recloss_plugins.maxtext import loss as rm_loss

REQUIRED = os.environ.get("RECLOSS_REQUIRE_MAXTEXT") == "1"


@pytest.fixture(scope="module")
def train():
    try:
        return importlib.import_module(rm_loss._TRAIN_MODULE)
    except ImportError as err:
        if REQUIRED:
            pytest.fail(f"RECLOSS_REQUIRE_MAXTEXT=1 but {rm_loss._TRAIN_MODULE} does not import: {err!r}")
        pytest.skip(f"MaxText is not installed (Python >= 3.12: pip install 'recloss[maxtext]'): {err}")


def test_the_leg_imported_maxtext(train):
    from importlib import metadata

    import maxtext
    version = tuple(int(p) for p in metadata.version("maxtext").split(".")[:3])
    assert version >= (0, 2, 5), metadata.version("maxtext")
    assert train.__name__ == "maxtext.trainers.pre_train.train"
    assert os.path.dirname(maxtext.__file__) in train.__file__   # the installed package, not a stand-in
    assert "site-packages" in train.__file__


def test_maxtext_loss_fn_and_hook_signatures_are_what_the_plugin_calls(train):
    """recloss's loss_fn takes MaxText's loss_fn arguments and calls its hook with the hook's own."""
    params = lambda f: list(inspect.signature(f).parameters)
    assert params(train.loss_fn) == params(rm.loss_fn)
    hook = getattr(train, rm_loss._HOOK)
    assert params(hook)[:5] == ["model", "hidden_states", "data", "config", "is_train"]
    assert params(rm.vocab_loss)[:5] == params(hook)[:5]


def test_maxtext_config_class_is_the_base_of_ours(train):
    from maxtext.configs import types as maxtext_types

    cls = rm.config_class()
    assert issubclass(cls, maxtext_types.MaxTextConfig) and cls is not maxtext_types.MaxTextConfig
    assert set(rm.FIELDS) <= set(cls.model_fields)
    assert not set(rm.FIELDS) & set(maxtext_types.MaxTextConfig.model_fields)
