"""Config loading: base.yml completeness, overrides, inheritance, and the errors users see."""

import pathlib
import re
import types

import pytest
import yaml

import recloss
from recloss_plugins.config import (LOSS_OPTION_KEYS, SCHEMA, ConfigError, LossOptionError, build_loss_options,
                                    default_config_path, dump_config, load_config, loss_options, option_for)

pytestmark = pytest.mark.tier1

CONFIGS = pathlib.Path(__file__).resolve().parents[1] / "configs"
BASE = CONFIGS / "base.yml"     # a link to the package's own copy, default_config_path()


def test_base_yml_sets_every_key_once_with_a_comment_and_the_declared_type():
    text = BASE.read_text()
    data = yaml.safe_load(text)
    assert set(data) == set(SCHEMA), (set(data) ^ set(SCHEMA))
    for key in SCHEMA:
        lines = [l for l in text.splitlines() if re.match(rf"^{key}:", l)]
        assert len(lines) == 1, key
        assert "#" in lines[0] and lines[0].split("#", 1)[1].strip(), f"{key} has no comment"
    cfg = load_config([str(BASE)])
    for key, spec in SCHEMA.items():
        value = cfg[key]
        assert value is None and spec.optional or isinstance(value, spec.type), (key, value)


def test_every_config_file_in_configs_loads():
    files = sorted(CONFIGS.glob("*.yml"))
    assert BASE in files and len(files) >= 2
    assert BASE.resolve() == default_config_path().resolve()     # the shipped base config is the repository's
    for f in files:
        load_config([str(f)])


def test_overrides_are_parsed_to_the_key_type():
    cfg = load_config([str(BASE), "steps=100", "learning_rate=1e-3", "dropout=0", "untie_embeddings=true",
                       "focal_alpha=0.25", "loss_interpret=none", "mesh_axes=[fsdp,data,vocab]",
                       "run_name=007", "--seed=3", "yambda_event_types=listen,like", "steps=1e3"])
    assert cfg.steps == 1000 and isinstance(cfg.steps, int)   # later override wins
    assert cfg.learning_rate == 1e-3 and isinstance(cfg.learning_rate, float)
    assert cfg.dropout == 0.0 and isinstance(cfg.dropout, float)
    assert cfg.untie_embeddings is True
    assert cfg.focal_alpha == 0.25 and cfg.loss_interpret is None
    assert list(cfg.mesh_axes) == ["fsdp", "data", "vocab"]
    assert cfg.run_name == "007" and cfg.seed == 3
    assert list(cfg.yambda_event_types) == ["listen", "like"]


def test_yaml_scientific_notation_without_dot_is_a_float(tmp_path):
    f = tmp_path / "exp.yml"
    f.write_text(f"base_config: {BASE}\nlearning_rate: 5e-4\nweight_decay: 1\n")
    cfg = load_config([str(f)])
    assert cfg.learning_rate == 5e-4 and cfg.weight_decay == 1.0


@pytest.mark.parametrize("arg, key, fragment", [
    ("learnig_rate=0.1", "learnig_rate", "did you mean 'learning_rate'"),
    ("stepss=3", "stepss", "did you mean 'steps'"),
    ("steps=abc", "steps", "must be an int"),
    ("steps=-1", "steps", "an int >= 0"),
    ("steps=1.5", "steps", "must be an int"),
    ("dropout=1.5", "dropout", "[0, 1)"),
    ("dtype=float16", "dtype", "one of ['float32', 'bfloat16']"),
    ("dataset_type=synthtic", "dataset_type", "did you mean 'synthetic'"),
    ("loss=cutbc", "loss", "did you mean 'cutbce'"),
    ("label_smoothing=1.0", "label_smoothing", "label_smoothing"),
    ("pos_weight=0", "pos_weight", "pos_weight"),
    ("focal_alpha=2", "focal_alpha", "focal_alpha"),
    ("untie_embeddings=maybe", "untie_embeddings", "a bool"),
    ("learning_rate=nan", "learning_rate", "finite"),
    ("num_heads=3", "num_heads", "must divide emb_dim"),
    ("mesh_axes=[data,fsdp]", "mesh_axes", "each of"),
    ("ici_fsdp_parallelism=-1", "ici_fsdp_parallelism", "at most one"),
    ("ici_vocab_parallelism=0", "ici_vocab_parallelism", "-1"),
    ("dataset_type=interactions", "dataset_path", "must name a file"),
    ("synthetic_min_len=500", "synthetic_min_len", "<= synthetic_max_len"),
])
def test_bad_overrides_fail_naming_the_key(arg, key, fragment):
    with pytest.raises(ConfigError) as err:
        load_config([str(BASE), arg])
    msg = str(err.value)
    assert repr(key) in msg, msg
    assert fragment in msg, msg


def test_not_key_value_and_base_config_override_are_rejected():
    with pytest.raises(ConfigError, match="not key=value"):
        load_config([str(BASE), "steps"])
    with pytest.raises(ConfigError, match="base_config cannot be overridden"):
        load_config([str(BASE), "base_config=x.yml"])


def test_inheritance_chain_relative_paths_and_precedence(tmp_path):
    (tmp_path / "sub").mkdir()
    mid = tmp_path / "mid.yml"
    mid.write_text(f"base_config: {BASE}\nsteps: 7\nemb_dim: 32\n")
    leaf = tmp_path / "sub" / "leaf.yml"
    leaf.write_text("base_config: ../mid.yml\nsteps: 9\n")
    cfg = load_config([str(leaf), "emb_dim=16"])
    assert cfg.steps == 9           # leaf over mid
    assert cfg.emb_dim == 16        # command line over files
    assert cfg.mlp_dim == yaml.safe_load(BASE.read_text())["mlp_dim"]   # from base


def test_file_errors(tmp_path):
    bad = tmp_path / "bad.yml"
    bad.write_text(f"base_config: {BASE}\nlerning_rate: 0.1\n")
    with pytest.raises(ConfigError, match=r"unknown config key 'lerning_rate' \(in .*bad.yml\); did you mean"):
        load_config([str(bad)])
    partial = tmp_path / "partial.yml"
    partial.write_text("steps: 3\n")
    with pytest.raises(ConfigError, match="does not set"):
        load_config([str(partial)])
    a, b = tmp_path / "a.yml", tmp_path / "b.yml"
    a.write_text("base_config: b.yml\n")
    b.write_text("base_config: a.yml\n")
    with pytest.raises(ConfigError, match="cycle"):
        load_config([str(a)])
    with pytest.raises(ConfigError, match="does not exist"):
        load_config([str(tmp_path / "nope.yml")])
    notmap = tmp_path / "list.yml"
    notmap.write_text("- 1\n- 2\n")
    with pytest.raises(ConfigError, match="must be a mapping"):
        load_config([str(notmap)])
    broken = tmp_path / "broken.yml"
    broken.write_text("steps: [1, 2\n")
    with pytest.raises(ConfigError, match="not valid YAML"):
        load_config([str(broken)])


def test_dump_round_trips_and_config_is_locked(tmp_path):
    cfg = load_config([str(BASE), "steps=17", "focal_alpha=0.5", "mesh_axes=[vocab,data,fsdp]"])
    out = tmp_path / "resolved.yml"
    dump_config(cfg, out)
    back = load_config([str(out)])
    assert {k: back[k] for k in SCHEMA} == {k: cfg[k] for k in SCHEMA}
    with pytest.raises(AttributeError):
        cfg.not_a_key = 1


def test_loss_options_mapping():
    cfg = load_config([str(BASE), "loss_block_v=256", "loss_block_n=0", "label_smoothing=0.1",
                       "loss_threshold=-1.5", "focal_gamma=2", "vocab_reduction=sum"])
    opts = loss_options(cfg, vocab_size=1001)
    assert opts.block_v == 256 and opts.block_n is None
    assert opts.label_smoothing == 0.1 and opts.threshold == -1.5 and opts.focal_gamma == 2.0
    assert opts.vocab_reduction == "sum" and opts.pad_id == 0 and opts.vocab_size == 1001
    assert opts.reduction == "mean"


def test_loss_option_keys_name_each_field_once():
    fields = [option.field for option in LOSS_OPTION_KEYS.values()]
    assert len(fields) == len(set(fields)) and set(fields) <= set(recloss.LossOptions.field_names())
    # Other spellings of a field convert as its row does; a key naming no field has no row.
    assert option_for("block_v") is option_for("loss_block_v") is LOSS_OPTION_KEYS["loss_block_v"]
    assert option_for("threshold") is LOSS_OPTION_KEYS["loss_threshold"]
    assert option_for("loss_label_smoothing") is LOSS_OPTION_KEYS["label_smoothing"]
    assert option_for("reduction").field == "reduction" and option_for("loss_reduction").field == "reduction"
    assert option_for("steps") is None and option_for("loss_steps") is None


def test_build_loss_options_converts_and_names_the_bad_key():
    assert build_loss_options({"loss_block_v": 0, "block_n": 64, "vocab_size": 0, "loss_interpret": False}) == \
        recloss.LossOptions(block_v=None, block_n=64, vocab_size=None, interpret=False)
    with pytest.raises(LossOptionError, match=r"'loss_threshold'=0.5 and 'threshold'=0.25") as err:
        build_loss_options({"loss_threshold": 0.5, "threshold": 0.25})
    assert err.value.key == "threshold"
    with pytest.raises(LossOptionError, match=r"loss config key 'pos_weight'=0.0 is rejected: .*pos_weight") as err:
        build_loss_options({"label_smoothing": 0.1, "pos_weight": 0.0})
    assert err.value.key == "pos_weight" and err.value.reason.startswith("LossOptions.pos_weight=0.0")


def test_one_loss_mapping_serves_every_plugin():
    from recloss_plugins import maxtext
    from recloss_plugins.flax import resolve_config

    cfg = load_config([str(BASE), "loss=cutbce_pallas", "loss_block_v=0", "loss_block_n=32",
                       "label_smoothing=0.1", "pos_weight=2", "focal_gamma=1", "focal_alpha=0.25",
                       "loss_threshold=-0.5", "loss_interpret=true", "vocab_reduction=sum"])
    values = {key: cfg[key] for key in LOSS_OPTION_KEYS if key in SCHEMA}
    assert len(values) == 16  # every loss option of the trainer's config (4 of them the sampled objective's)
    trainer = loss_options(cfg)
    assert resolve_config({"loss": cfg.loss, **values}) == \
        ("cutbce_pallas", trainer.replace(pad_id=recloss.LossOptions().pad_id))
    assert maxtext.loss_settings(types.SimpleNamespace(loss=cfg.loss, **values)) == \
        ("cutbce_pallas", trainer.replace(reduction="sum", pad_id=maxtext.FIELDS["loss_pad_id"].default))


def test_base_yml_loss_defaults_are_the_loss_options_defaults():
    # A softmax strategy refuses BCE-only options set to anything but their default (and vice versa), so
    # base.yml, which every config inherits, must hold exactly recloss.LossOptions' defaults.
    data = yaml.safe_load(BASE.read_text())
    trainer_keys = [key for key in LOSS_OPTION_KEYS if key in SCHEMA]
    assert {"z_loss", "temperature"} <= set(trainer_keys)
    assert build_loss_options({key: data[key] for key in trainer_keys}) == recloss.LossOptions()
    for name in recloss.available_strategies():
        cfg = load_config([str(BASE), f"loss={name}"])
        assert recloss.get_strategy(name, loss_options(cfg)).name == name


def test_softmax_options_map_and_load():
    cfg = load_config([str(BASE), "loss=cutce", "z_loss=1e-4", "temperature=0.5", "label_smoothing=0.1",
                       "loss_block_v=128"])
    opts = loss_options(cfg, vocab_size=512)
    assert (opts.z_loss, opts.temperature, opts.label_smoothing, opts.block_v) == (1e-4, 0.5, 0.1, 128)
    assert recloss.get_strategy(cfg.loss, opts).objective == "softmax"
    assert load_config([str(BASE), "loss=dense_ce"]).loss == "dense_ce"
    for name in ("cutce", "cutbce_pallas"):    # the soft cap: both objectives, null (off) by default
        assert loss_options(load_config([str(BASE), f"loss={name}", "logit_soft_cap=30"])).logit_soft_cap == 30.0
    assert loss_options(load_config([str(BASE)])).logit_soft_cap is None


@pytest.mark.parametrize("args, key, fragment", [
    (["loss=cutce", "pos_weight=2"], "pos_weight", "strategy 'cutce' (softmax objective"),
    (["loss=dense_ce", "vocab_reduction=sum"], "vocab_reduction", "strategy 'dense_ce'"),
    (["loss=cutce", "focal_gamma=2"], "focal_gamma", "strategy 'cutce'"),
    (["loss=cutce", "focal_alpha=0.25"], "focal_alpha", "strategy 'cutce'"),
    (["loss=cutce", "loss_threshold=0.5"], "loss_threshold", "strategy 'cutce'"),
    (["loss=cutbce", "z_loss=1e-4"], "z_loss", "strategy 'cutbce' (bce objective"),
    (["loss=dense_bce", "temperature=0.5"], "temperature", "strategy 'dense_bce'"),
    (["loss=cutce", "temperature=0"], "temperature", "temperature=0.0"),
    (["loss=cutce", "z_loss=-1"], "z_loss", "z_loss=-1.0"),
    (["loss=cutbce", "logit_soft_cap=0"], "logit_soft_cap", "logit_soft_cap=0.0"),
    (["loss=cutce", "logit_soft_cap=-30"], "logit_soft_cap", "logit_soft_cap=-30.0"),
    (["loss=gbce", "logit_soft_cap=30"], "logit_soft_cap", "strategy 'gbce' (sampled objective"),
    (["loss=cutce", "logit_soft_cap=30", "label_smoothing=0.1"], "loss", "label_smoothing=0.1 together with "
                                                                         "logit_soft_cap=30.0"),
])
def test_options_of_the_other_objective_fail_naming_key_and_strategy(args, key, fragment):
    with pytest.raises(ConfigError) as err:
        load_config([str(BASE), *args])
    msg = str(err.value)
    assert msg.startswith(f"config key {key!r}"), msg
    assert fragment in msg, msg


def test_options_of_the_other_objective_fail_in_yaml_too(tmp_path):
    exp = tmp_path / "exp.yml"
    exp.write_text(f"base_config: {BASE}\nloss: cutce\npos_weight: 3.0\n")
    with pytest.raises(ConfigError, match=r"config key 'pos_weight' \(in .*exp.yml\).*strategy 'cutce'.*"
                                          r"default 1.0"):
        load_config([str(exp)])
    load_config([str(exp), "pos_weight=1"])  # the default is fine for every strategy


def test_main_reports_config_errors_with_exit_code_2(capsys):
    from recloss_plugins.sasrec.train import main
    assert main([str(BASE), "learnig_rate=1"]) == 2
    err = capsys.readouterr().err
    assert "learnig_rate" in err and "learning_rate" in err
    assert main([str(BASE), "loss=cutce", "pos_weight=2"]) == 2
    err = capsys.readouterr().err
    assert "config error" in err and "'pos_weight'" in err and "'cutce'" in err


def test_sampled_options_map_and_load():
    cfg = load_config([str(BASE), "loss=sampled_softmax", "num_negatives=256", "in_batch_negatives=true",
                       "remove_accidental_hits=false", "temperature=0.5", "sampled_proposal=uniform"])
    opts = loss_options(cfg, vocab_size=512)
    assert (opts.num_negatives, opts.in_batch_negatives, opts.remove_accidental_hits, opts.temperature) == \
        (256, True, False, 0.5)
    assert recloss.get_strategy(cfg.loss, opts).objective == "sampled"
    assert loss_options(load_config([str(BASE), "loss=gbce", "gbce_t=0.2"])).gbce_t == 0.2


@pytest.mark.parametrize("args, key, fragment", [
    (["loss=cutbce", "num_negatives=64"], "num_negatives", "strategy 'cutbce' (bce objective"),
    (["loss=gbce", "in_batch_negatives=true"], "in_batch_negatives", "strategy 'gbce' (sampled objective"),
    (["loss=cutce", "gbce_t=0.5"], "gbce_t", "it is an option of the sampled objective"),
    (["loss=gbce", "gbce_t=1.5"], "gbce_t", "expected a float in [0, 1]"),
    (["loss=sampled_softmax", "num_negatives=0"], "num_negatives", "an int >= 1"),
    (["loss=sampled_softmax", "sampled_proposal=zipf"], "sampled_proposal", "counts"),
])
def test_sampled_option_errors_name_the_key(args, key, fragment):
    with pytest.raises(ConfigError) as info:
        load_config([str(BASE), *args])
    assert repr(key) in str(info.value) and fragment in str(info.value), str(info.value)


def test_sampled_proposal_auto_is_each_losss_own_and_an_explicit_value_wins():
    import numpy as np

    from recloss_plugins.sasrec.program import PROPOSAL_BY_LOSS, proposal_log_q, proposal_of
    assert load_config([]).sampled_proposal == "auto"
    counts = np.arange(11.0)
    for loss in ("sampled_softmax", "gbce"):
        cfg = load_config([f"loss={loss}"])
        assert proposal_of(cfg) == PROPOSAL_BY_LOSS[loss] == "uniform"
        lq = proposal_log_q(cfg, 11, counts)
        assert lq[0] == -np.inf and np.allclose(lq[1:], -np.log(10))
        explicit = load_config([f"loss={loss}", "sampled_proposal=counts"])
        assert proposal_of(explicit) == "counts"
        np.testing.assert_allclose(np.exp(proposal_log_q(explicit, 11, counts))[1:], counts[1:] / counts.sum(), rtol=1e-6)
