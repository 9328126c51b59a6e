"""recloss-train's and the MaxText plugin's config resolution, held to a record: a fixed set of configs
(good ones and ones that must fail) resolves to the same values, loss options and errors as recorded.

The record, tests/data/config_resolution.json, is what this module printed when it was written; a
change that moves a resolved value or an error's words fails here, naming the config. When the change
is meant, re-record it and read the diff:

    JAX_PLATFORMS=cpu .venv/bin/python tests/test_config_resolution.py --record

The MaxText side runs on attribute namespaces (no MaxText needed): `loss_settings`, the mesh keys and
`check_supported`, which MaxText's own config validation calls.
"""

from __future__ import annotations

import json
import pathlib
import sys
import types

import pytest

pytestmark = pytest.mark.tier1

RECORD = pathlib.Path(__file__).with_name("data") / "config_resolution.json"

# recloss-train: [config file (relative to the repository), key=value, ...]
TRAINER = {
    "base": ["configs/base.yml"],
    "yambda": ["configs/sasrec_yambda.yml", "dataset_type=synthetic"],
    "every bce option": ["configs/base.yml", "loss=cutbce_pallas", "label_smoothing=0.1", "pos_weight=2",
                         "focal_gamma=1.5", "focal_alpha=0.25", "loss_threshold=0.5", "vocab_reduction=sum",
                         "loss_block_v=256", "loss_block_n=16", "logit_soft_cap=30", "loss_interpret=true"],
    "every softmax option": ["configs/base.yml", "loss=cutce", "z_loss=0.001", "temperature=0.7",
                             "label_smoothing=0.1"],
    "sampled": ["configs/base.yml", "loss=sampled_softmax", "num_negatives=64", "in_batch_negatives=true",
                "remove_accidental_hits=false", "sampled_proposal=uniform"],
    "gbce": ["configs/base.yml", "loss=gbce", "gbce_t=0.5"],
    "rows gather": ["configs/base.yml", "loss=cutbce", "ici_data_parallelism=1", "ici_fsdp_parallelism=8",
                    "loss_fsdp_gather=rows"],
    "ring gather, dense": ["configs/base.yml", "loss=dense_bce", "loss_fsdp_gather=ring"],
    "pod": ["configs/sasrec_yambda.yml", "compile_topology=v5e-256", "global_batch_size=1024",
            "vocab_size=10000000", "ici_data_parallelism=32", "ici_vocab_parallelism=8"],
    "row-wise adagrad, bf16 table": ["configs/base.yml", "item_optimizer=rowwise_adagrad", "item_learning_rate=0.03",
                                     "item_table_dtype=bfloat16"],
    "bf16 table on adamw": ["configs/base.yml", "item_table_dtype=bfloat16"],
    "adagrad key on adamw": ["configs/base.yml", "item_learning_rate=0.03"],
    "unknown strategy": ["configs/base.yml", "loss=cutbse"],
    "softmax option on bce": ["configs/base.yml", "loss=cutbce", "z_loss=0.1"],
    "bce option on softmax": ["configs/base.yml", "loss=cutce", "pos_weight=2"],
    "cap on sampled": ["configs/base.yml", "loss=gbce", "logit_soft_cap=5"],
    "cap with smoothing, softmax": ["configs/base.yml", "loss=cutce", "logit_soft_cap=5", "label_smoothing=0.1"],
    "bad smoothing": ["configs/base.yml", "label_smoothing=1.5"],
    "bad cap": ["configs/base.yml", "logit_soft_cap=-1"],
    "bad gather": ["configs/base.yml", "loss_fsdp_gather=tree"],
    "bad reduction": ["configs/base.yml", "vocab_reduction=max"],
    "unknown key": ["configs/base.yml", "pos_weigth=2"],
    "bad negatives": ["configs/base.yml", "loss=sampled_softmax", "num_negatives=0"],
}

# The MaxText plugin: attributes of a MaxText config (absent ones take the plugin's defaults).
MAXTEXT = {
    "defaults": {},
    "cutce tiling": dict(loss="cutce", num_vocab_tiling=2),
    "cutce z-loss from MaxText": dict(loss="cutce", num_vocab_tiling=2, z_loss_multiplier=1e-4),
    "z-loss twice": dict(loss="cutce", num_vocab_tiling=2, z_loss_multiplier=1e-4, z_loss=1e-3),
    "z-loss on bce": dict(loss="cutbce", num_vocab_tiling=2, z_loss_multiplier=1e-4),
    "tied soft cap": dict(loss="cutce", num_vocab_tiling=2, final_logits_soft_cap=30.0, logits_via_embedding=True),
    "untied soft cap": dict(loss="cutce", num_vocab_tiling=2, final_logits_soft_cap=30.0),
    "two caps": dict(loss="cutce", num_vocab_tiling=2, final_logits_soft_cap=30.0, logits_via_embedding=True,
                     logit_soft_cap=20.0),
    "cap on sampled": dict(loss="gbce", num_vocab_tiling=2, final_logits_soft_cap=30.0, logits_via_embedding=True),
    "no tiling": dict(loss="cutce", num_vocab_tiling=1),
    "every bce option": dict(loss="cutbce_pallas", num_vocab_tiling=4, label_smoothing=0.1, pos_weight=2.0,
                             focal_gamma=1.5, focal_alpha=0.25, loss_threshold=0.5, vocab_reduction="sum",
                             loss_block_v=256, loss_block_n=16),
    "bce option on softmax": dict(loss="cutce_pallas", num_vocab_tiling=2, pos_weight=2.0),
    "sampled": dict(loss="sampled_softmax", num_vocab_tiling=2, num_negatives=64, vocab_size=1000),
    "too many negatives": dict(loss="sampled_softmax", num_vocab_tiling=2, num_negatives=5000, vocab_size=1000),
    "mesh keys": dict(loss="cutce_pallas", num_vocab_tiling=2, loss_batch_axes=["data", "fsdp"],
                      loss_fsdp_axis="fsdp"),
    "rows": dict(loss="cutce_pallas", num_vocab_tiling=2, loss_batch_axes=["data", "fsdp"], loss_fsdp_axis="fsdp",
                 loss_fsdp_gather="rows"),
    "ring without fsdp axis": dict(loss="cutce", num_vocab_tiling=2, loss_fsdp_gather="ring"),
    "ring on dense": dict(loss="dense_ce", num_vocab_tiling=2, loss_batch_axes=["data", "fsdp"],
                          loss_fsdp_axis="fsdp", loss_fsdp_gather="ring"),
    "bad gather": dict(loss="cutce", num_vocab_tiling=2, loss_batch_axes=["data"], loss_fsdp_gather="tree"),
    "axes without batch axes": dict(loss="cutce", num_vocab_tiling=2, loss_vocab_axis="tensor"),
    "unknown strategy": dict(loss="cutce_palas", num_vocab_tiling=2),
}


def _root() -> pathlib.Path:
    return pathlib.Path(__file__).resolve().parents[1]


def _error(err: BaseException) -> dict:
    return {"error": type(err).__name__, "message": str(err)}


def trainer_case(argv) -> dict:
    """What recloss-train resolves ``argv`` to: every config value and the LossOptions, or the error."""
    import contextlib

    from recloss_plugins.config import load_config
    from recloss_plugins.config.keys import loss_options

    with contextlib.chdir(_root()):
        try:
            cfg = load_config(argv)
        except Exception as err:  # noqa: BLE001 - the error is the result
            return _error(err)
    return {"config": {key: (list(v) if isinstance(v, tuple) else v) for key, v in cfg.items()},
            "loss_options": repr(loss_options(cfg))}


def maxtext_case(attrs: dict) -> dict:
    """What the MaxText plugin resolves a config of ``attrs`` to: the strategy, LossOptions and mesh keys
    (`loss_settings`), and what `check_supported` says."""
    from recloss_plugins.maxtext import config as mt

    ns = types.SimpleNamespace(**attrs)
    out = {}
    try:
        name, options = mt.loss_settings(ns)
        out["settings"] = [name, repr(options)]
        out["mesh"] = repr(mt._mesh_axes(ns))
    except Exception as err:  # noqa: BLE001
        out["settings"] = _error(err)
    try:
        mt.check_supported(ns)
        out["check"] = "ok"
    except Exception as err:  # noqa: BLE001
        out["check"] = _error(err)
    return out


def resolve_all() -> dict:
    return {"trainer": {name: trainer_case(argv) for name, argv in TRAINER.items()},
            "maxtext": {name: maxtext_case(attrs) for name, attrs in MAXTEXT.items()}}


@pytest.fixture(scope="module")
def resolved():
    return resolve_all()


def _recorded():
    assert RECORD.exists(), f"no record {RECORD}: write it with `python tests/{pathlib.Path(__file__).name} --record`"
    return json.loads(RECORD.read_text())


@pytest.mark.parametrize("name", list(TRAINER))
def test_the_trainer_resolves_as_recorded(name, resolved):
    assert resolved["trainer"][name] == _recorded()["trainer"][name], TRAINER[name]


@pytest.mark.parametrize("name", list(MAXTEXT))
def test_the_maxtext_plugin_resolves_as_recorded(name, resolved):
    assert resolved["maxtext"][name] == _recorded()["maxtext"][name], MAXTEXT[name]


def test_the_record_holds_both_outcomes():
    """A record of only successes (or only failures) would check half of what it claims."""
    rec = _recorded()
    for side in ("trainer", "maxtext"):
        assert set(rec[side]) == set(TRAINER if side == "trainer" else MAXTEXT)
    outcomes = [("error" in r) for r in rec["trainer"].values()]
    assert any(outcomes) and not all(outcomes)
    checks = [r["check"] == "ok" for r in rec["maxtext"].values()]
    assert any(checks) and not all(checks)


if __name__ == "__main__":
    if sys.argv[1:] != ["--record"]:
        sys.exit(f"usage: python {sys.argv[0]} --record   (writes {RECORD})")
    sys.path.insert(0, str(_root()))
    RECORD.parent.mkdir(exist_ok=True)
    RECORD.write_text(json.dumps(resolve_all(), indent=1, sort_keys=True) + "\n")
    print(f"wrote {RECORD}")
