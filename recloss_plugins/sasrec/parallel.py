"""Devices, mesh and shardings of the trainer (MaxText conventions).

Mesh shape: per axis a in mesh_axes, ici_a_parallelism × dcn_a_parallelism
(one -1 per group fills the remaining devices per slice / slices).
Shardings:

    batch arrays [B, ...]     P(batch_axes, None, ...)           batch_axes = (data, fsdp), and vocab
                                                                 when B divides over all three
                                                                 (`model_batch_axes`)
    item table [V_rows, D]    the strategy's table spec: rows over (vocab, fsdp)
    output bias [V_rows]      the strategy's bias spec
    other params, ndim >= 2   leading dim over fsdp when it divides, else replicated
    optimizer state           mirrors the params; counters replicated
"""

from __future__ import annotations

import math
from typing import Optional, Sequence, Tuple

import jax
import numpy as np
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec as P

import recloss
from recloss import aot


class MeshError(ValueError):
    """The parallelism keys do not fit the devices."""


# ----------------------------------------------------------------------------- mesh
def _fill(shape: Sequence[int], total: int, what: str, keys: Sequence[str]) -> Tuple[int, ...]:
    shape = list(shape)
    known = math.prod(s for s in shape if s != -1)
    if -1 in shape:
        if total % known:
            raise MeshError(f"{what}: {total} does not divide by the fixed degrees "
                            f"{dict(zip(keys, shape))} (product {known})")
        shape[shape.index(-1)] = total // known
    if math.prod(shape) != total:
        raise MeshError(f"{what}: the degrees {dict(zip(keys, shape))} multiply to {math.prod(shape)}, "
                        f"but there are {total}; set one of {list(keys)} to -1 or fix the product")
    return tuple(shape)


def num_slices_of(devices) -> int:
    idx = {getattr(d, "slice_index", 0) or 0 for d in devices}
    return len(idx)


def mesh_shape(cfg, num_devices: int, num_slices: int = 1):
    """(ici shape, dcn shape) in mesh_axes order, -1s filled."""
    axes = list(cfg.mesh_axes)
    if num_devices % num_slices:
        raise MeshError(f"{num_devices} devices do not split into {num_slices} slices")
    ici_keys = [f"ici_{a}_parallelism" for a in axes]
    dcn_keys = [f"dcn_{a}_parallelism" for a in axes]
    ici = _fill([cfg[k] for k in ici_keys], num_devices // num_slices, "devices per slice", ici_keys)
    dcn = _fill([cfg[k] for k in dcn_keys], num_slices, "slices", dcn_keys)
    return ici, dcn


def build_mesh(cfg, devices=None, num_slices: Optional[int] = None) -> Mesh:
    """A Mesh over ``devices`` (default: all) with axes ``cfg.mesh_axes``, all of them Auto.

    Auto on purpose, whatever JAX's default (`jax.make_mesh` makes Explicit axes in current
    JAX): the trainer shards by `jit`'s in/out shardings and lets XLA propagate them through
    the model (MaxText's convention). On Explicit axes every intermediate of the model would
    carry its sharding in its type, which the model's ops do not annotate. The loss itself
    takes either kind (`recloss.MeshLayout` lays out its inputs; tests/test_conventions.py).
    """
    from jax.experimental import mesh_utils

    devices = list(jax.devices() if devices is None else devices)
    num_slices = num_slices_of(devices) if num_slices is None else num_slices
    ici, dcn = mesh_shape(cfg, len(devices), num_slices)
    if num_slices > 1:
        arr = mesh_utils.create_hybrid_device_mesh(ici, dcn, devices, allow_split_physical_axes=True)
    else:
        try:
            arr = mesh_utils.create_device_mesh(ici, devices, allow_split_physical_axes=True)
        except (NotImplementedError, ValueError, AssertionError):
            # Device kinds without a physical-topology rule: plain order.
            arr = np.asarray(devices, dtype=object).reshape(ici)
    names = tuple(cfg.mesh_axes)
    return Mesh(arr, names, axis_types=(AxisType.Auto,) * len(names))


def layout_for(mesh: Mesh, fsdp_gather: str = "once") -> recloss.MeshLayout:
    """The loss's layout on the trainer's mesh; ``fsdp_gather``: the config's ``loss_fsdp_gather``."""
    return recloss.MeshLayout(mesh, batch_axes=("data", "fsdp"), fsdp_axis="fsdp", vocab_axis="vocab",
                              fsdp_gather=fsdp_gather)


# ----------------------------------------------------------------------------- shardings
TABLE_PARAMS = (("item_emb", "embedding"), ("out_table",))
BIAS_PARAMS = (("out_bias",),)


def path_names(path) -> tuple:
    """The names of a pytree key path (dict keys, attribute names, sequence indices), e.g.
    ('item_emb', 'embedding'); the one reading of a path for shardings and checkpoint checks."""
    return tuple(next((getattr(k, a) for a in ("key", "name", "idx") if hasattr(k, a)), k) for k in path)


def param_specs(params, layout: recloss.MeshLayout, specs: recloss.Specs):
    """PartitionSpec tree for a params tree (see the module docstring)."""
    fsdp = layout.fsdp_shards

    def rule(path, x):
        names = path_names(path)
        if names in TABLE_PARAMS:
            return specs.table
        if names in BIAS_PARAMS:
            return specs.bias
        if x.ndim >= 2 and fsdp > 1 and x.shape[0] % fsdp == 0:
            return P(layout.fsdp_axis, *([None] * (x.ndim - 1)))
        return P()

    return jax.tree_util.tree_map_with_path(rule, params)


def opt_state_specs(opt_state_shapes, p_specs):
    """Specs of an optax state: a leaf that belongs to a parameter (its key path ends with the
    parameter's) takes the parameter's spec, cut to the leaf's rank (row-wise AdaGrad's [rows]
    accumulator of a [rows, D] table is split like the table's rows); the rest (counts) replicated.
    The paths say it all, through any nesting of transformations (chain, multi_transform's masks)."""
    by_path = {}
    jax.tree_util.tree_map_with_path(lambda path, spec: by_path.__setitem__(path_names(path), spec), p_specs,
                                     is_leaf=lambda x: isinstance(x, P))

    def rule(path, leaf):
        names = path_names(path)
        spec = next((by_path[names[i:]] for i in range(len(names)) if names[i:] in by_path), P())
        return P(*spec[:leaf.ndim]) if len(spec) > leaf.ndim else spec

    return jax.tree_util.tree_map_with_path(rule, opt_state_shapes)


def named(mesh: Mesh, spec_tree):
    return jax.tree.map(lambda s: NamedSharding(mesh, s), spec_tree, is_leaf=lambda x: isinstance(x, P))


def model_batch_axes(layout: recloss.MeshLayout, batch_size: int) -> Tuple[str, ...]:
    """The axes the train step splits its batch arrays, and so the model's work, over: the loss's
    batch axes, and the vocab axis too when ``batch_size`` divides over all of them.

    The loss needs each vocab shard to see all rows of its batch shard; the model does not. Split
    over the vocab axis, the model runs once per row instead of once per vocab shard (|vocab|× less
    work and activation memory per chip), and XLA all-gathers the hidden rows over the vocab axis
    into the loss's shard_map (their gradient reduce-scattered back)."""
    axes = tuple(layout.batch_axes)
    if layout.vocab_shards > 1 and batch_size % (layout.batch_shards * layout.vocab_shards) == 0:
        axes += (layout.vocab_axis,)
    return axes


def describe_model_split(layout: recloss.MeshLayout, axes: Sequence[str], batch_size: int) -> str:
    """One line for the run log: what the model's batch is split over, and why not the vocab axis."""
    split = layout.vocab_axis is not None and layout.vocab_axis in axes
    ways = layout.batch_shards * (layout.vocab_shards if split else 1)
    line = f"model: batch split over {tuple(axes)} ({ways} ways)"
    if split:
        return line + f"; the loss all-gathers its rows over {layout.vocab_axis!r}"
    if layout.vocab_shards > 1:
        unit = layout.batch_shards * layout.vocab_shards
        return (line + f"; replicated over the {layout.vocab_shards} {layout.vocab_axis!r} shards because the "
                f"global batch {batch_size} is not a multiple of {unit}: one that is splits the model's work "
                f"{layout.vocab_shards} ways more")
    return line


def batch_specs(layout: recloss.MeshLayout, axes: Optional[Sequence[str]] = None):
    """Specs of the train step's batch arrays, split on their leading dim over ``axes`` (default
    the loss's batch axes; `model_batch_axes` for the step's inputs)."""
    axes = tuple(layout.batch_axes if axes is None else axes)
    b = axes[0] if len(axes) == 1 else axes
    return {"inputs": P(b, None), "targets": P(b, None, None), "weights": P(b, None)}


def put_global(arr: np.ndarray, sharding: NamedSharding) -> jax.Array:
    """A global array from a host array every process holds whole (each places its shards)."""
    return jax.make_array_from_callback(arr.shape, sharding, lambda idx: arr[idx])


def process_rows(sharding: NamedSharding, global_rows: int) -> Tuple[int, int]:
    """[lo, hi): the rows of a [global_rows, ...] batch this process's devices hold under ``sharding``.

    Raises MeshError unless they are one contiguous block (what a per-process input pipeline feeds)."""
    idx = sharding.addressable_devices_indices_map((global_rows,))
    spans = sorted({(s[0].start or 0, global_rows if s[0].stop is None else s[0].stop) for s in idx.values()})
    lo, hi = spans[0][0], spans[-1][1]
    covered = sum(b - a for a, b in spans)
    if covered != hi - lo:
        raise MeshError(f"process {jax.process_index()} holds batch rows {spans}, not one contiguous block; "
                        "a per-process input pipeline needs the batch axes to follow the process order")
    return lo, hi


def put_process_local(local: np.ndarray, sharding: NamedSharding, global_rows: int) -> jax.Array:
    """A global [global_rows, ...] array from this process's rows only (`process_rows`), via
    jax.make_array_from_process_local_data: no process holds another process's rows."""
    lo, hi = process_rows(sharding, global_rows)
    if local.shape[0] != hi - lo:
        raise MeshError(f"process {jax.process_index()} fed {local.shape[0]} batch rows, but its devices hold "
                        f"rows [{lo}, {hi}) of {global_rows}")
    return jax.make_array_from_process_local_data(sharding, local, (global_rows,) + local.shape[1:])


def to_host(x) -> np.ndarray:
    """A (possibly multi-process) global array as one numpy array on every process."""
    if jax.process_count() > 1:
        from jax.experimental import multihost_utils
        return np.asarray(multihost_utils.process_allgather(x, tiled=True))
    return np.asarray(jax.device_get(x))


# ----------------------------------------------------------------------------- TPU topologies
def topology_devices(name: str, num_slices: int = 1):
    """Devices of TPU topology ``compile_topology=name`` for ahead-of-time compilation (no TPU needed;
    `recloss.aot.topology_devices`); MeshError naming the key when the name is not one."""
    try:
        return list(aot.topology_devices(name, num_slices))
    except aot.TopologyError as err:
        raise MeshError(f"compile_topology={name!r}: {err}") from err
