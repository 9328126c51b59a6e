"""The few JAX names that moved between releases, in one place (jax >= 0.10.2)."""

from __future__ import annotations

import inspect

import jax


def shard_map(f, *, mesh, in_specs, out_specs, check_vma: bool = True):
    """`jax.shard_map`; `check_vma` was called `check_rep` in older APIs."""
    params = inspect.signature(jax.shard_map).parameters
    flag = "check_vma" if "check_vma" in params else "check_rep"
    return jax.shard_map(f, mesh=mesh, in_specs=in_specs, out_specs=out_specs, **{flag: check_vma})


def tpu_compiler_params(**kwargs):
    """`pltpu.CompilerParams` (named `TPUCompilerParams` in some releases)."""
    from jax.experimental.pallas import tpu as pltpu
    cls = getattr(pltpu, "CompilerParams", None) or getattr(pltpu, "TPUCompilerParams")
    return cls(**kwargs)


def axis_types(mesh) -> dict:
    """{axis name: 'explicit' | 'auto' | 'manual'} of a mesh (all 'auto' where JAX has no axis types)."""
    types = getattr(mesh, "axis_types", None) or ()
    names = tuple(mesh.axis_names)
    if len(types) != len(names):
        return {a: "auto" for a in names}
    return {a: str(getattr(t, "name", t)).lower() for a, t in zip(names, types)}


def _spec_axes(spec) -> tuple:
    """The mesh axis names a PartitionSpec mentions, in order."""
    out = []
    for entry in spec:
        if entry is None:
            continue
        out.extend((entry,) if isinstance(entry, str) else tuple(entry))
    return tuple(out)


def place(x, mesh, spec):
    """``x`` laid out as NamedSharding(mesh, spec), eagerly or under jit, on Explicit or Auto meshes.

    A mesh with Explicit axes (`jax.make_mesh`'s default in current JAX) carries shardings in the
    array types: `jax.sharding.reshard` moves ``x`` there (its transpose moves the cotangent back).
    On an Auto mesh (`jax.sharding.Mesh(devices, names)`) the layout is a hint:
    `jax.lax.with_sharding_constraint`. Raises a ValueError for a spec mixing Explicit and Auto axes.
    """
    from jax.sharding import NamedSharding

    types = axis_types(mesh)
    named = {types[a] for a in _spec_axes(spec)}
    explicit = "explicit" in set(types.values())
    if not explicit:
        return jax.lax.with_sharding_constraint(x, NamedSharding(mesh, spec))
    if named - {"explicit"}:
        raise ValueError(f"cannot lay out an array as {spec} on a mesh with axis types {types}: the spec "
                         f"mixes Explicit and other axes; make the loss's axes all Explicit or all Auto")
    return _reshard()(x, NamedSharding(mesh, spec))


def _reshard():
    """`jax.sharding.reshard` (`jax.experimental.shard.reshard` in releases before it moved)."""
    fn = getattr(jax.sharding, "reshard", None)
    if fn is None:
        from jax.experimental.shard import reshard as fn
    return fn
