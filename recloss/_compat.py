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
