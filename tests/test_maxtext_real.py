"""The Python 3.12 leg really runs against MaxText: it imports, and its hooks (and the soft cap the plugin
maps) are where the plugin expects.

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

pytestmark = [pytest.mark.tier2, pytest.mark.stack]

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


def test_maxtext_soft_caps_only_the_tied_output_head(train):
    """`maxtext_soft_cap` maps final_logits_soft_cap onto logit_soft_cap only with
    logits_via_embedding, because MaxText's apply_output_head reads the cap only in that branch."""
    import ast
    import textwrap

    from maxtext.layers import nnx_decoders
    tree = ast.parse(textwrap.dedent(inspect.getsource(nnx_decoders.NNXDecoder.apply_output_head)))
    branch = next(n for n in ast.walk(tree) if isinstance(n, ast.If) and "logits_via_embedding" in ast.unparse(n.test))
    reads = lambda nodes: "final_logits_soft_cap" in "".join(ast.unparse(n) for n in nodes)
    assert reads(branch.body), "MaxText no longer caps the tied head's logits: revisit maxtext_soft_cap"
    assert not reads(branch.orelse), "MaxText now caps the logits_dense head too: revisit maxtext_soft_cap"
    rest = [n for n in tree.body[0].body if n is not branch and branch not in list(ast.walk(n))]
    assert not reads(rest), "MaxText reads final_logits_soft_cap outside the logits_via_embedding branch"
