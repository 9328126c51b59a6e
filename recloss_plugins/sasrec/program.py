"""The jitted programs of a run (init, train step, evaluation) for a config, a mesh and a vocabulary.

Shared by training on local devices and ahead-of-time compilation for a TPU
topology: nothing here touches data or files.

State (a pytree of global arrays):
    params     pure dict of the SASRec parameters (float32)
    opt_state  optax AdamW state
    step       int32 scalar: optimizer steps taken
    rng        uint32 [2] key data of a PRNG_IMPL key; step s uses dropout key fold_in(rng, s)

Every key is a `PRNG_IMPL` (threefry2x32) key made with an explicit ``impl`` and drawn with
``jax_threefry_partitionable`` on, whatever the process's ``jax_default_prng_impl`` says
(MaxText's ``train.main`` sets it to unsafe_rbg globally): parameters, dropout, negatives and
checkpoints are the same under any global setting. A checkpoint records the implementation
(``prng_impl`` in its meta) and one of another implementation is refused by name (`train`).

A sampled loss (``loss: sampled_softmax | gbce``) draws step s's negatives with
`negatives_key(seed, s)` (the run seed and the step only, so a resumed run draws
what an uninterrupted one would) from its proposal (`proposal_of`), held like the
table's rows: uniform is made inside the step from the row ids (`uniform_log_q`);
counts reach the step as its third argument, a [rows] array split over the vocab
axis that each process fills for its own chips' rows from the training split's item
counts (`Program.step_inputs`, `log_q_rows`): no chip and no host holds a [V] array
for it.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import functools
import math
from typing import Any, Callable, Dict, Optional, Tuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec as P

import recloss
from recloss_plugins.config import SCHEMA, loss_options
from recloss_plugins.sasrec import optim, parallel
from recloss_plugins.sasrec.eval import sharded_top_k
from recloss_plugins.sasrec.model import SASRec, compute_dtype, tied_lookup


def base_rate_logit(num_labels: int, vocab_size: int) -> float:
    """log(p / (1 - p)) for p = L / (V - 1), the chance a given item is among L targets."""
    p = min(num_labels / max(vocab_size - 1, 1), 0.5)
    return math.log(p / (1 - p))


# The trainer's PRNG implementation, pinned: never the global jax_default_prng_impl.
PRNG_IMPL = "threefry2x32"


def make_key(seed):
    """A typed ``PRNG_IMPL`` key of ``seed`` (the global default implementation plays no part)."""
    return jax.random.key(seed, impl=PRNG_IMPL)


def wrap_key(data):
    """The ``PRNG_IMPL`` key whose uint32 key data is ``data`` (the state's ``rng``)."""
    return jax.random.wrap_key_data(data, impl=PRNG_IMPL)


def pinned_random():
    """The context every random draw of the trainer is traced and lowered in: threefry's
    partitionable bit generation on (JAX's default), whatever the process set (a JAX without the
    switch has only that behaviour)."""
    switch = getattr(jax, "threefry_partitionable", None)
    return switch(True) if switch is not None else contextlib.nullcontext()


# Tags the negatives' key stream apart from the parameter and dropout streams of the same seed.
_NEGATIVES_TAG = 0x73616D70
# Tags the stochastic rounding of 16-bit parameters apart from the step's dropout draw.
_ROUNDING_TAG = 0x726F756E


def negatives_key(seed: int, step):
    """The key of step ``step``'s sampled negatives: fold_in(fold_in(make_key(seed), tag), step)."""
    return jax.random.fold_in(jax.random.fold_in(make_key(seed), _NEGATIVES_TAG), step)


# ``sampled_proposal: auto``: where each sampled loss draws its negatives. gbce: uniform, as gSASRec
# (its β calibrates for a uniform rate, and it has no logQ correction). sampled_softmax: uniform too:
# on a real 1,682-item log the counts proposal at K = 128 (then with accidental hits removed) fell
# below the popularity baseline while uniform did not (issue 23); see docs/choosing-a-loss.md.
PROPOSAL_BY_LOSS = {"sampled_softmax": "uniform", "gbce": "uniform"}


def proposal_of(cfg) -> str:
    """The proposal a config's sampled loss draws from: ``sampled_proposal``, or for ``auto`` the
    loss's own (`PROPOSAL_BY_LOSS`)."""
    if cfg.sampled_proposal != "auto":
        return cfg.sampled_proposal
    return PROPOSAL_BY_LOSS.get(cfg.loss, "uniform")


def proposal_log_q(cfg, vocab_size: int, item_counts=None):
    """[V] float32 log proposal of a config's sampled loss: `log_q_of` its `proposal_of`."""
    return log_q_of(proposal_of(cfg), vocab_size, item_counts)


def log_q_of(proposal: str, vocab_size: int, item_counts=None):
    """[V] float32 log proposal ``proposal``, normalised (a host-side reference: `tools.sampled_bias`):
    `log_q_rows` over every id."""
    lq = log_q_rows(proposal, vocab_size, item_counts, 0, vocab_size)
    if not np.any(np.isfinite(lq)):   # no counts: uniform
        lq = log_q_rows("uniform", vocab_size, None, 0, vocab_size)
    return np.asarray(jax.nn.log_softmax(jnp.asarray(lq)))


def log_q_rows(proposal: str, vocab_size: int, item_counts, lo: int, hi: int) -> np.ndarray:
    """Rows lo..hi−1 of the unnormalised log proposal [hi − lo] float32: 'counts' (with counts) log c_v
    (−inf where c_v = 0), else uniform (0); the padding id 0 and rows at or past vocab_size −inf.

    Reads only ``item_counts[lo:hi]`` (a memory-mapped popularity.npy stays on disk but for them)."""
    ids = np.arange(lo, hi)
    live = (ids > 0) & (ids < vocab_size)
    if proposal == "counts" and item_counts is not None:
        c = np.zeros(hi - lo, np.float64)
        n = max(0, min(hi, vocab_size, len(item_counts)) - lo)
        c[:n] = np.asarray(item_counts[lo:lo + n], np.float64)
        live &= c > 0
        w = np.log(np.where(live, c, 1.0))
    else:
        w = np.zeros(hi - lo)
    return np.where(live, w, -np.inf).astype(np.float32)


def counts_any(item_counts, vocab_size: int, chunk: int = 1 << 22) -> bool:
    """Whether any item 1..V−1 has a count > 0, read ``chunk`` ids at a time (stops at the first)."""
    n = min(vocab_size, len(item_counts))
    return any(np.any(np.asarray(item_counts[max(lo, 1):min(lo + chunk, n)]) > 0) for lo in range(0, n, chunk))


def uniform_log_q(rows: int, vocab_size: int):
    """The uniform proposal's [rows] log weights, traced: 0 for ids 1..V−1, −inf for the padding id
    and the rows past V. Made inside the step, so XLA lays it out as the loss takes it (the table's
    vocab split): no [V] constant in the program."""
    ids = jax.lax.iota(jnp.int32, rows)
    return jnp.where((ids > 0) & (ids < vocab_size), 0.0, -jnp.inf).astype(jnp.float32)


def make_model(cfg, rows: int, rngs: nnx.Rngs, vocab_size: Optional[int] = None) -> SASRec:
    bias0 = base_rate_logit(cfg.num_labels, vocab_size or rows)
    return SASRec(output_bias_init=bias0, vocab_rows=rows, max_seq_len=cfg.max_seq_len, emb_dim=cfg.emb_dim,
                  num_layers=cfg.num_layers, num_heads=cfg.num_heads, mlp_dim=cfg.mlp_dim,
                  dropout=cfg.dropout, dtype=compute_dtype(cfg.dtype),
                  untie_embeddings=cfg.untie_embeddings, use_output_bias=cfg.use_output_bias,
                  table_dtype=compute_dtype(cfg.item_table_dtype), rngs=rngs)


def learning_rate_schedule(cfg) -> optax.Schedule:
    """Linear warm-up 0 -> learning_rate over warmup_steps, then cosine decay to
    learning_rate·learning_rate_final_fraction at `steps`."""
    warmup = min(cfg.warmup_steps, max(cfg.steps, 1))
    return optax.warmup_cosine_decay_schedule(
        init_value=0.0, peak_value=cfg.learning_rate, warmup_steps=warmup,
        decay_steps=max(cfg.steps, warmup + 1), end_value=cfg.learning_rate * cfg.learning_rate_final_fraction)


def make_optimizer(cfg):
    """(optax transform, schedule): global-norm clipping, then AdamW (decay on matrices only), with the
    item tables on row-wise AdaGrad under ``item_optimizer: rowwise_adagrad`` (`optim.make_optimizer`)."""
    schedule = learning_rate_schedule(cfg)
    return optim.make_optimizer(cfg, schedule), schedule


def global_batch_size(cfg, layout: recloss.MeshLayout, num_devices: int) -> int:
    b = cfg.global_batch_size or cfg.per_device_batch_size * num_devices
    if b % layout.batch_shards:
        key = "global_batch_size" if cfg.global_batch_size else "per_device_batch_size"
        raise parallel.MeshError(f"config key {key!r}: the global batch {b} does not split over "
                                 f"{layout.batch_shards} batch shards (data x fsdp); use a multiple of "
                                 f"{layout.batch_shards}")
    return b


@dataclasses.dataclass
class Program:
    cfg: Any
    mesh: Any
    layout: recloss.MeshLayout
    strategy: recloss.Strategy
    vocab_size: int            # real V (ids 0..V-1, 0 = padding)
    rows: int                  # table rows allocated (>= V, divisible over the table shards)
    batch_size: int            # global
    graphdef: Any
    tx: Any
    schedule: Callable
    abstract_state: Any        # ShapeDtypeStructs with shardings
    state_shardings: Any
    batch_shardings: Dict[str, NamedSharding]
    init: Callable             # () -> state
    train_step: Callable       # (state, batch, inputs) -> (state, metrics); inputs: `step_inputs`
    eval_top_k: Callable       # (params, inputs [U, N], lengths [U]) -> (scores [U, K], ids [U, K])
    prng_impl: str = PRNG_IMPL  # the implementation of every key (recorded in checkpoints)
    manual: Optional[recloss.MeshLayout] = None   # the loss's layout when the step is data parallel by hand
    model_batch_axes: Tuple[str, ...] = ()        # what the batch arrays are split over (`parallel.model_batch_axes`)
    gather: Optional[Any] = None                  # loss_fsdp_gather=auto: the `recloss.choose_fsdp_gather` pick
    inputs_shardings: Dict[str, NamedSharding] = dataclasses.field(default_factory=dict)   # `step_inputs`
    _compiled: Any = dataclasses.field(default=None, repr=False)

    def lowered_train_step(self):
        """The train step lowered for the abstract state, batch and step inputs."""
        return self.train_step.lower(self.abstract_state, self.abstract_batch(), self.abstract_inputs())

    def compiled_train_step(self, compiler_options=None):
        """The train step compiled for the abstract state and batch (once per Program; ``compiler_options``,
        e.g. `recloss.aot.dump_options`, apply to that one compile)."""
        if self._compiled is None:
            with pinned_random():
                self._compiled = self.lowered_train_step().compile(compiler_options=compiler_options)
        return self._compiled

    def abstract_inputs(self):
        """The step's third argument as ShapeDtypeStructs (`step_inputs`)."""
        return {k: jax.ShapeDtypeStruct((self.rows,), jnp.float32, sharding=sh)
                for k, sh in self.inputs_shardings.items()}

    def step_inputs(self, item_counts=None) -> Dict[str, Any]:
        """The train step's third argument: {} unless the loss draws from a counts proposal, then
        {"log_q": [rows] float32} (`log_q_rows` of ``item_counts`` [V], the training split's
        counts; None: uniform), laid out as the loss takes it; each process makes only its own
        chips' rows, so a memory-mapped popularity.npy is read just there."""
        return {k: jax.make_array_from_callback(
                    (self.rows,), sh, lambda index: log_q_rows(
                        "counts", self.vocab_size, item_counts, *_bounds(index[0], self.rows)))
                for k, sh in self.inputs_shardings.items()}

    def abstract_batch(self, batch_size=None):
        b = self.batch_size if batch_size is None else batch_size
        n, l = self.cfg.max_seq_len, self.cfg.num_labels
        sh = self.batch_shardings
        return {"inputs": jax.ShapeDtypeStruct((b, n), jnp.int32, sharding=sh["inputs"]),
                "targets": jax.ShapeDtypeStruct((b, n, l), jnp.int32, sharding=sh["targets"]),
                "weights": jax.ShapeDtypeStruct((b, n), jnp.float32, sharding=sh["weights"])}


# The loss metrics a train step hands to the host, those of the strategy's objective: BCE strategies
# count tp/fp/fn (precision, recall), softmax ones top1 and mean_lse; both weight_sum and the target counts.
STEP_METRICS = ("tp", "fp", "fn", "top1", "mean_lse", "weight_sum", "num_targets", "invalid_targets")


# Keys that change nothing inside the jitted programs (run bookkeeping and data
# loading; the vocabulary arrives as an argument).
_NON_PROGRAM_KEYS = frozenset({
    "run_name", "base_output_directory", "log_period", "enable_tensorboard", "enable_checkpointing",
    "checkpoint_period", "max_checkpoints_to_keep", "eval_interval", "eval_max_users", "eval_batch_size",
    "compile_topology", "compile_fit_hbm_gib", "dataset_type", "dataset_path", "file_format", "user_column",
    "item_column", "timestamp_column", "min_user_interactions", "vocab_size",
}) | {k for k in SCHEMA if k.startswith(("yambda_", "synthetic_"))}
_PROGRAMS: "collections.OrderedDict" = collections.OrderedDict()
_MAX_PROGRAMS = 4


def program_for(cfg, mesh, vocab_size: int, *, batch_size=None) -> Program:
    """`build_program`, memoised on everything that shapes the programs, so runs in one
    process with the same model (a resume, a sweep over run names) compile once. (A counts
    proposal's values are the step's argument, `Program.step_inputs`: not part of the program.)"""
    key = (tuple((k, _hashable(cfg[k])) for k in SCHEMA if k not in _NON_PROGRAM_KEYS),
           tuple(d.id for d in mesh.devices.flat), mesh.devices.shape, tuple(mesh.axis_names),
           mesh.devices.flat[0].device_kind, vocab_size, batch_size)
    if key in _PROGRAMS:
        _PROGRAMS.move_to_end(key)
        return _PROGRAMS[key]
    program = build_program(cfg, mesh, vocab_size, batch_size=batch_size)
    _PROGRAMS[key] = program
    while len(_PROGRAMS) > _MAX_PROGRAMS:
        _PROGRAMS.popitem(last=False)
    return program


def _hashable(v):
    return tuple(v) if isinstance(v, (list, tuple)) else v


def build_program(cfg, mesh, vocab_size: int, *, batch_size=None) -> Program:
    """Everything jitted for ``cfg`` on ``mesh`` with a ``vocab_size``-id vocabulary."""
    auto = cfg.loss_fsdp_gather == "auto"
    layout = parallel.layout_for(mesh, "once" if auto else cfg.loss_fsdp_gather)
    platform = layout.platform
    rows = recloss.padded_vocab_size(vocab_size, layout)
    strategy = recloss.get_strategy(cfg.loss, loss_options(cfg, vocab_size=vocab_size))
    try:
        strategy.check_platform(platform)
    except ValueError as err:
        raise ValueError(f"config key 'loss': {err}") from None
    b = batch_size or global_batch_size(cfg, layout, mesh.devices.size)
    gather = None
    if auto:
        gather = recloss.choose_fsdp_gather(strategy, layout, rows=b * cfg.max_seq_len // layout.batch_shards,
                                            vocab_size=vocab_size, features=cfg.emb_dim,
                                            itemsize=jnp.dtype(compute_dtype(cfg.dtype)).itemsize)
        layout = dataclasses.replace(layout, fsdp_gather=gather.mode)
    specs = strategy.partition_specs(layout)
    tx, schedule = make_optimizer(cfg)
    cdtype = compute_dtype(cfg.dtype)
    seed = cfg.seed

    abstract_model = nnx.eval_shape(lambda: make_model(cfg, rows, nnx.Rngs(make_key(0)), vocab_size))
    graphdef = nnx.graphdef(abstract_model)

    def init():
        keys = jax.random.split(make_key(seed), 2)
        model = make_model(cfg, rows, nnx.Rngs(params=keys[0]), vocab_size)
        params = nnx.to_pure_dict(nnx.state(model))
        return {"params": params, "opt_state": tx.init(params), "step": jnp.zeros((), jnp.int32),
                "rng": jax.random.key_data(keys[1])}

    with pinned_random():
        shapes = jax.eval_shape(init)
    p_specs = parallel.param_specs(shapes["params"], layout, specs)
    state_specs = {"params": p_specs, "opt_state": parallel.opt_state_specs(shapes["opt_state"], p_specs),
                   "step": P(), "rng": P()}
    state_sh = parallel.named(mesh, state_specs)
    abstract_state = jax.tree.map(lambda s, sh: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sh),
                                  shapes, state_sh)
    model_axes = parallel.model_batch_axes(layout, b)
    batch_sh = parallel.named(mesh, parallel.batch_specs(layout, model_axes))
    replicated = NamedSharding(mesh, P())

    sampled = strategy.objective == "sampled"
    manual = _manual_data_parallel(strategy, layout)
    # The step's third argument: a counts proposal's [rows] log weights, split as the loss takes them.
    inputs_sh = {}
    if sampled and proposal_of(cfg) == "counts":
        lq_spec = P() if manual is not None else strategy.extra_specs(layout, {"log_q": None})["log_q"]
        inputs_sh = {"log_q": NamedSharding(mesh, lq_spec)}

    def loss_fn(params, batch, step, inputs, *, rng=None, keep=None):
        """(loss, metrics) of the model on ``batch``: the sharded loss on ``layout``, or, under the
        step's own shard_map (``manual``), on this device's rows with the tied lookup's gradient
        written into the loss's dE (`tied_lookup`)."""
        vectors = None
        if manual is not None and "out_table" not in params:
            table, vectors = tied_lookup(params["item_emb"]["embedding"], batch["inputs"])
            params = dict(params, item_emb=dict(params["item_emb"], embedding=table))
        model = nnx.merge(graphdef, params)
        hidden = model(batch["inputs"], rng=rng, keep=keep, item_vectors=vectors)
        extra = {}
        if sampled:
            extra = dict(key=negatives_key(seed, step), log_q=inputs.get("log_q", uniform_log_q(rows, vocab_size)))
        table = model.output_table()     # narrowed to the compute dtype, never widened (a bf16 table stays)
        table = table.astype(cdtype) if table.dtype.itemsize > jnp.dtype(cdtype).itemsize else table
        out = strategy(hidden, table, batch["targets"], batch["weights"],
                       model.output_bias(), layout=layout if manual is None else manual, **extra)
        return out.loss, out.metrics

    def local_grads(params, batch, keep, step, inputs):
        """This device's rows under the step's shard_map over the batch axes: the global loss and
        metrics, and the parameters' gradients summed over the devices in place."""
        (loss, mets), grads = jax.value_and_grad(loss_fn, has_aux=True)(params, batch, step, inputs, keep=keep)
        return loss, mets, jax.tree.map(lambda g: recloss.psum_in_place(g, manual.batch_axes), grads)

    def train_step(state, batch, inputs):
        key_of_step = jax.random.fold_in(wrap_key(state["rng"]), state["step"])
        key = key_of_step if cfg.dropout > 0 else None
        if manual is None:
            grad_fn = jax.value_and_grad(loss_fn, has_aux=True)
            (loss, mets), grads = grad_fn(state["params"], batch, state["step"], inputs, rng=key)
        else:   # the masks drawn for the whole batch, as the sharded model would, then split
            keep = nnx.merge(graphdef, state["params"]).dropout_keep(key, batch["inputs"].shape)
            keep_spec = None if keep is None else P(None, *layout.batch_spec(3))
            fn = jax.shard_map(local_grads, mesh=mesh,
                               in_specs=(P(), parallel.batch_specs(layout), keep_spec, P(),
                                         {k: P() for k in inputs}),
                               out_specs=(P(), P(), P()), check_vma=False)
            loss, mets, grads = fn(state["params"], batch, keep, state["step"], inputs)
        gnorm = optax.tree.norm(grads)
        finite = jnp.isfinite(loss) & jnp.isfinite(gnorm)
        updates, opt_state = tx.update(grads, state["opt_state"], state["params"])
        params = optim.apply_updates(state["params"], updates, jax.random.fold_in(key_of_step, _ROUNDING_TAG))
        # A non-finite step leaves the state as it was; the host stops the run on seeing `finite`.
        keep = lambda new, old: jnp.where(finite, new, old)
        new_state = {"params": jax.tree.map(keep, params, state["params"]),
                     "opt_state": jax.tree.map(keep, opt_state, state["opt_state"]),
                     "step": state["step"] + 1, "rng": state["rng"]}
        metrics = {"loss": loss, "grad_norm": gnorm, "finite": finite,
                   "learning_rate": schedule(state["step"]),
                   **{k: mets[k] for k in STEP_METRICS if k in mets}}
        return new_state, metrics

    k = cfg.eval_top_k

    def eval_top_k(params, inputs, lengths):
        model = nnx.merge(graphdef, params)
        hidden = model(inputs)
        last = jnp.take_along_axis(hidden, (lengths - 1)[:, None, None], axis=1)[:, 0]
        # The table stays split as it is stored (its rows over vocab × fsdp): each chip ranks its rows.
        return sharded_top_k(last, model.output_table(), model.output_bias(), layout=layout, k=k,
                             block_v=cfg.eval_block_v, vocab_size=vocab_size)

    eval_in = (state_sh["params"], NamedSharding(mesh, layout.batch_spec(2)), NamedSharding(mesh, layout.batch_spec(1)))
    return Program(
        cfg=cfg, mesh=mesh, layout=layout, strategy=strategy, vocab_size=vocab_size, rows=rows, batch_size=b,
        graphdef=graphdef, tx=tx, schedule=schedule, abstract_state=abstract_state, state_shardings=state_sh,
        manual=manual, model_batch_axes=model_axes, gather=gather,
        batch_shardings=batch_sh,
        init=_pinned(jax.jit(init, out_shardings=state_sh)),
        train_step=jax.jit(train_step, in_shardings=(state_sh, batch_sh, inputs_sh),
                           out_shardings=(state_sh, replicated), donate_argnums=(0,)),
        inputs_shardings=inputs_sh,
        eval_top_k=jax.jit(eval_top_k, in_shardings=eval_in),
    )


def _bounds(index: slice, n: int) -> Tuple[int, int]:
    return (index.start or 0, n if index.stop is None else index.stop)


def _manual_data_parallel(strategy, layout: recloss.MeshLayout) -> Optional[recloss.MeshLayout]:
    """The loss's layout for a hand-written data-parallel step, or None for the sharded one.

    When the table is whole on every chip (no vocab or fsdp split) and the batch is split, the
    step runs the model and the loss under its own shard_map over the batch axes
    (`recloss.MeshLayout` ``manual``) and sums the gradients with `recloss.psum_in_place`: the
    table's gradient is one buffer, reduced in place, where XLA's all-reduce of the sharded step
    holds its operand and result (two table-sized buffers; docs/measurements.md "Measured choices")."""
    if layout.table_shards > 1 or layout.batch_shards == 1 or strategy.name.startswith("dense_"):
        return None   # the dense baselines' [M, V] logits dominate their peak: the plain sharded step
    batch = tuple(a for a in layout.batch_axes if layout.axis_size(a) > 1)
    manual = dataclasses.replace(layout, batch_axes=batch, fsdp_axis=None, vocab_axis=None, manual=True)
    try:
        strategy.check_manual()
    except ValueError:   # e.g. in-batch negatives need the whole batch: the sharded step
        return None
    return manual


def _pinned(fn):
    """``fn`` called (traced, lowered and run) in `pinned_random`."""
    @functools.wraps(fn)
    def call(*args, **kwargs):
        with pinned_random():
            return fn(*args, **kwargs)
    return call
