"""Test setup: 8 CPU devices, CPU platform, libtpu kept from probing for a real TPU."""

import os

# Must happen before jax is imported anywhere.
_flag = "--xla_force_host_platform_device_count=8"
if _flag not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " " + _flag).strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("TPU_SKIP_MDS_QUERY", "1")
# Several test processes (the two-process test, topology compiles) may load libtpu at once.
os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")

import jax  # noqa: E402
import pytest  # noqa: E402

import recloss  # noqa: E402


def strategies(objective: str = "bce"):
    """Every registered strategy of ``objective``; Pallas ones run in interpret mode on CPU."""
    return recloss.available_strategies(objective)


@pytest.fixture(params=None)
def rng(request):
    import numpy as np
    # Fresh inputs each run, but reproducible from the printed seed on failure.
    seed = int.from_bytes(os.urandom(4), "little")
    print(f"rng seed {seed}")
    return np.random.default_rng(seed)
