"""Multi-process start-up of recloss-train from the environment a launcher sets.

`initialize_from_env` decides whether this process is one of several and, if
so, calls `jax.distributed.initialize` before any JAX computation. The first
matching signal wins:

    RECLOSS_DISTRIBUTED=0|false|off     never (e.g. a one-host debug run on a pod worker)
    RECLOSS_DISTRIBUTED=1|true|on|auto  always; JAX detects what the environment leaves out
    JAX_COORDINATOR_ADDRESS             launch/local.py, launch/gcloud_tpu_vm.sh (or COORDINATOR_ADDRESS)
    MEGASCALE_NUM_SLICES > 1            GKE multi-slice (xpk --num-slices), also of one-host slices
    TPU_WORKER_HOSTNAMES or TPU_PROCESS_ADDRESSES with several hosts   GKE multi-host slice
    SLURM_NTASKS or OMPI_COMM_WORLD_SIZE > 1

Arguments passed on: ``coordinator_address`` from JAX_COORDINATOR_ADDRESS (or
COORDINATOR_ADDRESS), ``num_processes`` from JAX_NUM_PROCESSES (or xpk's
JAX_PROCESS_COUNT), ``process_id`` from JAX_PROCESS_ID; whatever is unset JAX
fills in from the cluster (Cloud TPU metadata, GKE, SLURM, Open MPI). This is a
superset of `parallel.maybe_initialize_distributed`, which misses multi-slice
jobs of one-host slices and has no switch to force or refuse initialisation.
"""

from __future__ import annotations

import dataclasses
import os
import re
from typing import Callable, Mapping, Optional

from recloss_plugins.config import ConfigError

_ON = ("1", "true", "on", "yes", "auto")
_OFF = ("0", "false", "off", "no")


class DistributedEnvError(ConfigError):
    """The environment describes a multi-process job inconsistently."""


@dataclasses.dataclass(frozen=True)
class DistributedSetup:
    reason: str          # which signal asked for initialisation
    kwargs: dict         # what jax.distributed.initialize was given


def _int(env: Mapping[str, str], key: str, lo: int) -> Optional[int]:
    text = env.get(key, "").strip()
    if not text:
        return None
    try:
        value = int(text)
    except ValueError:
        raise DistributedEnvError(f"environment variable {key}={text!r} is not an integer") from None
    if value < lo:
        raise DistributedEnvError(f"environment variable {key}={value} must be >= {lo}")
    return value


def _hosts(env: Mapping[str, str], key: str) -> int:
    # Only well-formed host names count: off a TPU VM, libtpu may leave a warning
    # sentence (with commas) in TPU_WORKER_HOSTNAMES.
    return sum(bool(re.fullmatch(r"[\w.\-:]+", h.strip())) for h in env.get(key, "").split(","))


def requested(env: Optional[Mapping[str, str]] = None) -> Optional[str]:
    """The signal (a short description) that asks for jax.distributed, or None for one process."""
    env = os.environ if env is None else env
    switch = env.get("RECLOSS_DISTRIBUTED", "").strip().lower()
    if switch in _OFF:
        return None
    if switch in _ON:
        return f"RECLOSS_DISTRIBUTED={env['RECLOSS_DISTRIBUTED']}"
    if switch:
        raise DistributedEnvError(f"environment variable RECLOSS_DISTRIBUTED={env['RECLOSS_DISTRIBUTED']!r} "
                                  f"is not one of {_ON + _OFF} (or unset)")
    for key in ("JAX_COORDINATOR_ADDRESS", "COORDINATOR_ADDRESS"):
        if env.get(key, "").strip():
            return key
    if (_int(env, "MEGASCALE_NUM_SLICES", 1) or 1) > 1:
        return f"MEGASCALE_NUM_SLICES={env['MEGASCALE_NUM_SLICES']}"
    for key in ("TPU_PROCESS_ADDRESSES", "TPU_WORKER_HOSTNAMES"):
        if _hosts(env, key) > 1:
            return f"{key} lists {_hosts(env, key)} hosts"
    for key in ("SLURM_NTASKS", "OMPI_COMM_WORLD_SIZE"):
        if (_int(env, key, 1) or 1) > 1:
            return f"{key}={env[key]}"
    return None


def initialize_kwargs(env: Optional[Mapping[str, str]] = None) -> dict:
    """The jax.distributed.initialize arguments the environment states (unset ones are left to JAX)."""
    env = os.environ if env is None else env
    kwargs = {}
    address = (env.get("JAX_COORDINATOR_ADDRESS") or env.get("COORDINATOR_ADDRESS") or "").strip()
    if address:
        if ":" not in address:
            raise DistributedEnvError(f"coordinator address {address!r} (JAX_COORDINATOR_ADDRESS) "
                                      "must be host:port")
        kwargs["coordinator_address"] = address
    num = _int(env, "JAX_NUM_PROCESSES", 1)
    if num is None:
        num = _int(env, "JAX_PROCESS_COUNT", 1)
    pid = _int(env, "JAX_PROCESS_ID", 0)
    if num is not None and pid is not None and pid >= num:
        raise DistributedEnvError(f"JAX_PROCESS_ID={pid} must be < the process count {num}")
    if num is not None:
        kwargs["num_processes"] = num
    if pid is not None:
        kwargs["process_id"] = pid
    return kwargs


def initialize_from_env(env: Optional[Mapping[str, str]] = None,
                        initialize: Optional[Callable[..., None]] = None) -> Optional[DistributedSetup]:
    """Calls jax.distributed.initialize when the environment asks for several processes.

    Args:
      env: the environment (default ``os.environ``).
      initialize: the function to call (default ``jax.distributed.initialize``; tests pass a fake).
    Returns:
      What was done, or None for a single-process run.
    Raises:
      DistributedEnvError: a malformed or inconsistent variable (named in the message).
    """
    env = os.environ if env is None else env
    reason = requested(env)
    if reason is None:
        return None
    kwargs = initialize_kwargs(env)
    if initialize is None:
        import jax
        initialize = jax.distributed.initialize
    initialize(**kwargs)
    return DistributedSetup(reason, kwargs)


def coordination_client():
    """JAX's coordination-service client (key-value store, barriers) once `jax.distributed` is
    started, else None. jax 0.10 to 0.12 expose it only as ``jax._src.distributed.global_state``."""
    from jax._src import distributed as jax_distributed
    return getattr(jax_distributed.global_state, "client", None)
