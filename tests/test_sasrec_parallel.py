"""Mesh shapes from the parallelism keys, parameter specs, topology names, multi-host
detection, the batch search of the AOT report, and (slow) TPU ahead-of-time compilation."""

import jax
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from recloss_plugins.config import default_config_path, load_config
from recloss_plugins.sasrec import aot, distributed, parallel


def _cfg(*extra):
    return load_config([str(default_config_path()), *extra])


@pytest.mark.tier1
def test_mesh_shape_fills_minus_one_and_rejects_bad_products():
    assert parallel.mesh_shape(_cfg(), 8) == ((8, 1, 1), (1, 1, 1))
    cfg = _cfg("ici_data_parallelism=2", "ici_fsdp_parallelism=-1", "ici_vocab_parallelism=2")
    assert parallel.mesh_shape(cfg, 8) == ((2, 2, 2), (1, 1, 1))
    cfg = _cfg("mesh_axes=[vocab,data,fsdp]", "ici_vocab_parallelism=4")
    assert parallel.mesh_shape(cfg, 8) == ((4, 2, 1), (1, 1, 1))
    assert parallel.mesh_shape(_cfg(), 8, num_slices=2) == ((4, 1, 1), (2, 1, 1))
    with pytest.raises(parallel.MeshError, match="multiply to 6"):
        parallel.mesh_shape(_cfg("ici_data_parallelism=3", "ici_fsdp_parallelism=2"), 8)
    with pytest.raises(parallel.MeshError, match="does not divide"):
        parallel.mesh_shape(_cfg("ici_fsdp_parallelism=3"), 8)


@pytest.mark.tier1
def test_build_mesh_on_cpu_devices_and_param_specs():
    import recloss
    cfg = _cfg("ici_data_parallelism=2", "ici_fsdp_parallelism=2", "ici_vocab_parallelism=2")
    mesh = parallel.build_mesh(cfg, jax.devices()[:8])
    assert dict(mesh.shape) == {"data": 2, "fsdp": 2, "vocab": 2}
    layout = parallel.layout_for(mesh)
    specs = recloss.get_strategy("cutbce").partition_specs(layout)
    params = {"item_emb": {"embedding": jax.ShapeDtypeStruct((512, 16), "float32")},
              "out_bias": jax.ShapeDtypeStruct((512,), "float32"),
              "blocks": {0: {"fc": {"kernel": jax.ShapeDtypeStruct((16, 32), "float32"),
                                    "bias": jax.ShapeDtypeStruct((32,), "float32")},
                             "odd": {"kernel": jax.ShapeDtypeStruct((3, 4), "float32")}}}}
    got = parallel.param_specs(params, layout, specs)
    assert got["item_emb"]["embedding"] == specs.table == P(("vocab", "fsdp"), None)
    assert got["out_bias"] == specs.bias
    assert got["blocks"][0]["fc"]["kernel"] == P("fsdp", None)
    assert got["blocks"][0]["fc"]["bias"] == P()
    assert got["blocks"][0]["odd"]["kernel"] == P()          # 3 rows do not split over fsdp=2


@pytest.mark.tier1
def test_model_batch_axes_take_the_vocab_axis_when_the_batch_divides():
    """The batch (and so the model) is split over the vocab axis too when the global batch divides over
    data × fsdp × vocab; otherwise the model runs replicated over it and the run log says why."""
    mesh = parallel.build_mesh(_cfg("ici_data_parallelism=2", "ici_fsdp_parallelism=2", "ici_vocab_parallelism=2"),
                               jax.devices()[:8])
    layout = parallel.layout_for(mesh)
    assert parallel.model_batch_axes(layout, 16) == ("data", "fsdp", "vocab")
    assert parallel.batch_specs(layout, ("data", "fsdp", "vocab"))["targets"] == P(("data", "fsdp", "vocab"), None, None)
    assert parallel.describe_model_split(layout, ("data", "fsdp", "vocab"), 16) == (
        "model: batch split over ('data', 'fsdp', 'vocab') (8 ways); the loss all-gathers its rows over 'vocab'")
    assert parallel.model_batch_axes(layout, 12) == ("data", "fsdp")
    assert parallel.batch_specs(layout)["inputs"] == layout.batch_spec(2)
    line = parallel.describe_model_split(layout, ("data", "fsdp"), 12)
    assert "replicated over the 2 'vocab' shards because the global batch 12 is not a multiple of 8" in line
    no_vocab = parallel.layout_for(parallel.build_mesh(_cfg("ici_data_parallelism=8"), jax.devices()[:8]))
    assert parallel.model_batch_axes(no_vocab, 16) == ("data", "fsdp")
    assert parallel.describe_model_split(no_vocab, ("data", "fsdp"), 16) == "model: batch split over ('data', 'fsdp') (8 ways)"


@pytest.mark.tier1
def test_a_topology_the_trainer_cannot_name_is_a_mesh_error_naming_the_key():
    with pytest.raises(parallel.MeshError, match="compile_topology='tpu8': 'tpu8' is not a known TPU name"):
        parallel.topology_devices("tpu8")
    with pytest.raises(parallel.MeshError, match="compile_topology='v6e-12': 'v6e-12': no v6e topology with 12 chips"):
        parallel.topology_devices("v6e-12")


@pytest.mark.tier1
def test_multihost_detection_is_env_driven():
    requested = distributed.requested
    assert not requested({})
    assert not requested({"TPU_WORKER_HOSTNAMES": "localhost"})
    assert requested({"TPU_WORKER_HOSTNAMES": "h0,h1"})
    assert not requested(
        {"TPU_WORKER_HOSTNAMES": "WARNING: could not determine TPU worker hostnames, please set it"})
    assert requested({"JAX_COORDINATOR_ADDRESS": "10.0.0.1:1234"})
    assert requested({"SLURM_NTASKS": "4"})
    assert not requested({"SLURM_NTASKS": "1", "OMPI_COMM_WORLD_SIZE": "1"})
    assert distributed.initialize_from_env({}) is None


@pytest.mark.tier1
@pytest.mark.parametrize("slope, fixed, budget, unit, start", [
    (1.0, 0.0, 100, 8, 64), (1.0, 0.0, 7, 8, 64), (1.0, 0.0, 64, 8, 64), (3.0, 50.0, 3000, 16, 16),
    (1.0, 0.0, 8, 8, 64), (0.5, 2.0, 127, 4, 4), (1.0, 0.0, 10**9, 8, 64)])
def test_largest_fitting_batch(slope, fixed, budget, unit, start, rng):
    wiggle = rng.uniform(0, 0.3, size=100000)     # memory: affine plus a small increasing wobble
    wiggle = np.cumsum(wiggle) / 1000
    calls = []

    def measure(b):
        calls.append(b)
        assert b % unit == 0 and b > 0
        return fixed + slope * b + wiggle[b]

    best = aot.largest_fitting_batch(measure, budget, unit, start, limit=4096)
    fits = [b for b in range(unit, 4097, unit) if measure(b) <= budget]
    calls.clear()
    best = aot.largest_fitting_batch(measure, budget, unit, start, limit=4096)
    assert best == (max(fits) if fits else 0)
    assert len(calls) <= 16


@pytest.mark.tier1
def test_largest_fitting_batch_with_compile_ooms():
    # Above 1000 the "compiler" refuses (inf); the answer is still found by bisection.
    measure = lambda b: float("inf") if b > 1000 else 2.0 * b
    assert aot.largest_fitting_batch(measure, 1900.0, 8, 64) == 944
    assert aot.largest_fitting_batch(measure, 5000.0, 8, 64) == 1000
    err = RuntimeError("RESOURCE_EXHAUSTED: E1000: CompileTimeHbmOom: XLA:TPU compile permanent error. "
                       "Ran out of memory in memory space hbm. Used 31.28G of 31.25G hbm.")
    assert aot.compile_oom(err) == "Used 31.28G of 31.25G hbm"
    assert aot.compile_oom(ValueError("shapes do not match")) is None
    # another wording keeps its first line naming the failure (a record said only "out of HBM")
    other = RuntimeError("jaxlib error\nRESOURCE_EXHAUSTED: Ran out of memory in memory space hbm: 19.36G "
                         "requested, 15.75G available\n  more")
    assert aot.compile_oom(other) == ("RESOURCE_EXHAUSTED: Ran out of memory in memory space hbm: 19.36G "
                                      "requested, 15.75G available")
    long = aot.compile_oom(RuntimeError("RESOURCE_EXHAUSTED: " + "x" * 1000))
    assert len(long) == aot.OOM_WORDS and long.endswith("…")


@pytest.mark.tier2
@pytest.mark.tpu_aot
def test_aot_compile_for_v6e_cutbce_uses_less_hbm_than_dense():
    # Large enough that dense logits dominate: 8 x 128 x 65,536 x 4 B = 256 MiB per chip each.
    base = ["compile_topology=v6e-8", "vocab_size=65536", "max_seq_len=128", "global_batch_size=64",
            "emb_dim=64", "num_heads=2", "mlp_dim=128", "num_layers=1"]
    res = {}
    for loss in ("dense_bce", "cutbce"):
        logs = []
        res[loss] = aot.compile_report(_cfg(*base, f"loss={loss}"), log=logs.append)
        assert any("per-chip HBM" in l for l in logs)
        assert res[loss]["memory"]["argument"] > 0
    assert res["cutbce"]["total_gib"] < res["dense_bce"]["total_gib"] - 0.25


@pytest.mark.tier1
def test_loss_fsdp_gather_auto_picks_by_the_shapes_and_an_explicit_mode_stays():
    """``loss_fsdp_gather=auto``: the trainer's loss layout takes `recloss.choose_fsdp_gather`'s pick for
    its batch and table (rows for a large catalogue, the ring for a small one on fsdp 8), logged as
    `Program.gather`; a mode set by name is used as set."""
    import recloss
    from recloss_plugins.sasrec import program as program_lib
    picked = {}
    for vocab in (100, 100_000):
        cfg = _cfg("loss=cutbce", "ici_data_parallelism=1", "ici_fsdp_parallelism=8", "loss_fsdp_gather=auto")
        mesh = parallel.build_mesh(cfg, jax.devices()[:8])
        program = program_lib.build_program(cfg, mesh, vocab, batch_size=16)
        want = recloss.choose_fsdp_gather(program.strategy, parallel.layout_for(mesh), rows=16 * cfg.max_seq_len // 8,
                                          vocab_size=vocab, features=cfg.emb_dim, itemsize=4)
        assert program.layout.fsdp_gather == want.mode == program.gather.mode
        assert program.gather.describe() == want.describe()
        picked[vocab] = want.mode
        explicit = program_lib.build_program(load_config([str(default_config_path()), "loss=cutbce",
                                                          "ici_data_parallelism=1", "ici_fsdp_parallelism=8",
                                                          "loss_fsdp_gather=once"]), mesh, vocab, batch_size=16)
        assert explicit.layout.fsdp_gather == "once" and explicit.gather is None
    assert picked == {100: "ring", 100_000: "rows"}


@pytest.mark.tier1
@pytest.mark.parametrize("vocab_parallelism", [4, 1])
def test_a_counts_proposal_reaches_the_step_split_like_the_table(rng, vocab_parallelism):
    """``sampled_proposal=counts`` on data 2 × vocab 4 (and on data 8, the hand-written data-parallel
    step): the step's log q argument is split like the table's rows (whole on every chip without a
    vocab split), each chip's rows are `log_q_rows` of the counts (padding id, zero counts and rows
    past V −inf), normalised it is the host reference `log_q_of`, and a step on it is finite."""
    from recloss_plugins.sasrec import program as program_lib
    vocab = 301
    counts = rng.integers(0, 5, size=vocab)
    cfg = _cfg("loss=sampled_softmax", "num_negatives=16", "sampled_proposal=counts",
               f"ici_vocab_parallelism={vocab_parallelism}")
    mesh = parallel.build_mesh(cfg, jax.devices()[:8])
    program = program_lib.build_program(cfg, mesh, vocab, batch_size=8)
    inputs = program.step_inputs(counts)
    lq = inputs["log_q"]
    assert lq.shape == (program.rows,) and program.rows > vocab
    assert lq.sharding.spec == (P("vocab") if vocab_parallelism > 1 else P())
    for s in lq.addressable_shards:
        lo, hi = program_lib._bounds(s.index[0], program.rows)
        np.testing.assert_array_equal(np.asarray(s.data), program_lib.log_q_rows("counts", vocab, counts, lo, hi))
    host = np.asarray(lq)
    assert np.all(np.isneginf(host[vocab:])) and np.isneginf(host[0]) and np.all(np.isneginf(host[:vocab][counts == 0]))
    ref = program_lib.log_q_of("counts", vocab, counts)
    np.testing.assert_allclose(np.exp(np.asarray(jax.nn.log_softmax(host[:vocab]))), np.exp(ref), rtol=1e-6, atol=0)
    state = program.init()
    batch = {k: jax.device_put(np.zeros(v.shape, v.dtype), v.sharding) for k, v in program.abstract_batch().items()}
    batch["inputs"] = jax.device_put(rng.integers(1, vocab, size=batch["inputs"].shape).astype(np.int32),
                                     program.batch_shardings["inputs"])
    batch["targets"] = jax.device_put(rng.integers(1, vocab, size=batch["targets"].shape).astype(np.int32),
                                      program.batch_shardings["targets"])
    batch["weights"] = jax.device_put(np.ones(batch["weights"].shape, np.float32), program.batch_shardings["weights"])
    _, metrics = program.compiled_train_step()(state, batch, inputs)
    assert bool(metrics["finite"]) and float(metrics["loss"]) > 0
