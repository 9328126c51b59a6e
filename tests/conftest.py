"""Test setup: 8 CPU devices, CPU platform, libtpu kept from probing for a real TPU; seeds that can
be replayed (RECLOSS_TEST_SEED); and global JAX config restored after every test."""

import os

# The suite is compile-bound (hundreds of small XLA:CPU programs), so XLA:CPU compiles cheaply here:
# - its LLVM back end at -O0 (about halves each compile; every HLO pass, the CPU buffer assignment and
#   TPU compiles are untouched: identical CPU temp bytes and v6e per-chip figures with and without it);
# - where this XLA still has them (jax 0.10.2 does, 0.12 does not: its compiles are that cheap already),
#   the elemental fusion emitters instead of the MLIR ones: a third less wall time for the oracle tests.
#   This one moves the CPU buffer assignment a little (cutbce's temporaries at one test shape: 1.93 ->
#   2.18 MB); the CPU memory tests assert bounds that hold either way, and libtpu reads no XLA:CPU flag.
# Only how fast CPU programs compile and run changes. An XLA_FLAGS that sets one of them itself wins.
TEST_XLA_OPT = "--xla_backend_optimization_level=0"
OPTIONAL_XLA_OPT = "--xla_cpu_use_fusion_emitters=false"
_OPT_ENV = "RECLOSS_TEST_XLA_OPT"     # the probe's answer, for xdist workers and launched processes


def _test_xla_opt() -> str:
    """TEST_XLA_OPT plus OPTIONAL_XLA_OPT when this XLA knows the flag (an unknown XLA flag aborts the
    process, so a child process tries it once; the answer is kept in the environment)."""
    if _OPT_ENV not in os.environ:
        import subprocess
        import sys
        probe = subprocess.run([sys.executable, "-c", "import jax; jax.devices('cpu')"], capture_output=True,
                               env=dict(os.environ, XLA_FLAGS=OPTIONAL_XLA_OPT, JAX_PLATFORMS="cpu"))
        os.environ[_OPT_ENV] = " ".join([TEST_XLA_OPT] + ([OPTIONAL_XLA_OPT] if probe.returncode == 0 else []))
    return os.environ[_OPT_ENV]


def xla_flags(devices: int = 8) -> str:
    """The XLA_FLAGS of this suite for a process of ``devices`` CPU devices (subprocesses use it too,
    so a launched run compiles as the test process does)."""
    return f"--xla_force_host_platform_device_count={devices} {_test_xla_opt()}"


# Must happen before jax is imported anywhere.
_have = os.environ.get("XLA_FLAGS", "")
_add = [f for f in xla_flags().split() if f.split("=")[0] not in _have]
os.environ["XLA_FLAGS"] = " ".join([_have, *_add]).strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("TPU_SKIP_MDS_QUERY", "1")
# Several test processes (the two-process test, topology compiles) may load libtpu at once.
os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")

import sys  # noqa: E402
import warnings  # noqa: E402

import jax  # noqa: E402
import pytest  # noqa: E402



# ----------------------------------------------------------------------------- seeds
SEED_ENV = "RECLOSS_TEST_SEED"
_SEEDS = {}   # what drew it (fixture name or test id) -> seed, reported with a failing test


def draw_seed(label: str) -> int:
    """A fresh 32-bit seed (os.urandom), or $RECLOSS_TEST_SEED when set; printed and remembered under
    ``label`` so a failing test's report says how to re-run it with the same data."""
    env = os.environ.get(SEED_ENV, "").strip()
    seed = int(env, 0) % 2**32 if env else int.from_bytes(os.urandom(4), "little")
    _SEEDS[label] = seed
    print(f"{label}: seed {seed} (re-run with {SEED_ENV}={seed})")
    return seed


@pytest.fixture(scope="session")
def fresh_seed():
    """`draw_seed`, for fixtures of any scope: ``fresh_seed("my_fixture")``."""
    return draw_seed


@pytest.fixture
def seed(request) -> int:
    """A fresh seed for this test (`draw_seed`), replayable with RECLOSS_TEST_SEED."""
    return draw_seed(request.node.nodeid)


@pytest.fixture
def rng(seed):
    """np.random.default_rng of this test's `seed`: fresh inputs each run, reproducible on failure."""
    import numpy as np
    return np.random.default_rng(seed)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    report = outcome.get_result()
    if report.failed:
        used = {k: v for k, v in _SEEDS.items() if k == item.nodeid or k in item.fixturenames}
        if used:
            report.sections.append(("seeds", "\n".join(
                f"{k}: {v}  (re-run: {SEED_ENV}={v} pytest {item.nodeid})" for k, v in used.items())))


def pytest_configure(config):
    # Hypothesis draws its own examples: RECLOSS_TEST_SEED fixes them too (as --hypothesis-seed would).
    env = os.environ.get(SEED_ENV, "").strip()
    if env:
        try:
            from hypothesis import core
        except ImportError:
            return
        if getattr(core, "global_force_seed", None) is None:
            core.global_force_seed = int(env, 0)


SEEDED_FIXTURES = {"seed", "rng", "fresh_seed"}


# ----------------------------------------------------------------------------- tiers
# Every test belongs to exactly one tier (docs/development.md): `tier1` is `make test`, what a
# contributor runs after every change; `tier2` is what costs minutes and guards something else
# (`make test-all` runs both). `stack` marks a test whose result depends on the software stack, which
# the newest-stack leg runs whatever its tier; a TPU compile (`tpu_aot`) always does.
TIERS = ("tier1", "tier2")


def tier_errors(items):
    """One line per test that carries no tier marker, or more than one."""
    errors = []
    for item in items:
        tiers = sorted({m.name for m in item.iter_markers() if m.name in TIERS})
        if len(tiers) != 1:
            errors.append(f"{item.nodeid}: {'no tier' if not tiers else 'tiers ' + ' and '.join(tiers)}")
    return errors


def pytest_collection_modifyitems(config, items):
    errors = tier_errors(items)
    if errors:
        raise pytest.UsageError(
            f"{len(errors)} test(s) without exactly one tier; mark each with pytest.mark.tier1 (every change, "
            "`make test`) or pytest.mark.tier2 (`make test-all`), as docs/development.md says:\n  "
            + "\n  ".join(errors))
    for item in items:
        if item.get_closest_marker("tpu_aot"):
            item.add_marker(pytest.mark.stack)
        # `-m seeded` selects every test whose inputs a seed decides (a seed fixture anywhere in its
        # fixture closure, or Hypothesis examples): the ones a sweep over RECLOSS_TEST_SEED re-runs.
        hypo = getattr(getattr(item, "obj", None), "is_hypothesis_test", False)
        if hypo or SEEDED_FIXTURES & set(getattr(item, "fixturenames", ())):
            item.add_marker(pytest.mark.seeded)


# ----------------------------------------------------------------------------- global JAX config
# Process-wide settings a test or an import can change for every later test of the session:
# MaxText's train.main sets jax_default_prng_impl=unsafe_rbg, its compile/decode entry points
# jax_use_shardy_partitioner, jax_remove_size_one_mesh_axis_from_type and the compilation cache
# keys, its nnx wrappers flax_always_shard_variable at import; tests set x64, precision, promotion.
JAX_CONFIG_KEYS = (
    "jax_default_prng_impl", "jax_enable_x64", "jax_default_matmul_precision", "jax_numpy_rank_promotion",
    "jax_numpy_dtype_promotion", "jax_threefry_partitionable", "jax_explain_cache_misses",
    "jax_use_shardy_partitioner", "jax_remove_size_one_mesh_axis_from_type", "jax_enable_compilation_cache",
    "jax_compilation_cache_dir", "jax_persistent_cache_min_entry_size_bytes",
    "jax_persistent_cache_min_compile_time_secs", "jax_debug_log_modules", "jax_debug_nans", "jax_debug_infs",
    "jax_disable_jit", "jax_log_compiles", "jax_enable_checks", "jax_legacy_prng_key", "jax_enable_custom_prng",
    "jax_softmax_custom_jvp",
)
FLAX_CONFIG_KEYS = ("flax_always_shard_variable",)


class JaxConfigLeak(UserWarning):
    """A test (or what it imported) left a global JAX/Flax config value changed; it was restored."""


def _config_values():
    out = {}
    for name in JAX_CONFIG_KEYS:
        try:
            out[("jax", name)] = getattr(jax.config, name)
        except AttributeError:      # not a key of this jax version
            pass
    flax = sys.modules.get("flax")
    if flax is not None:
        for name in FLAX_CONFIG_KEYS:
            try:
                out[("flax", name)] = getattr(flax.config, name)
            except AttributeError:
                pass
    return out


def _restore(where, name, value):
    owner = jax.config if where == "jax" else sys.modules["flax"].config
    owner.update(name, value)


try:  # imported up front, so a flax key changed by a test's first import of flax is seen too
    import flax  # noqa: E402,F401
except ImportError:  # pragma: no cover
    pass


@pytest.fixture(autouse=True)
def _isolate_global_jax_config(request):
    """Snapshots JAX_CONFIG_KEYS / FLAX_CONFIG_KEYS before each test and restores them after it,
    warning (JaxConfigLeak, naming each key) when the test left one changed."""
    before = _config_values()
    yield
    after = _config_values()
    changed = [(k, before[k], after[k]) for k in before if k in after and after[k] != before[k]]
    for (where, name), old, _ in changed:
        _restore(where, name, old)
    if changed:
        what = ", ".join(f"{name}={new!r} (was {old!r})" for (_, name), old, new in changed)
        warnings.warn(JaxConfigLeak(f"{request.node.nodeid} left global config changed: {what}; restored"),
                      stacklevel=1)


# ----------------------------------------------------------------------------- the shared 2-process run
class TwoProcessRun:
    """The one 2-process x 4-device launch the multi-process tests assert on (tests/_multiprocess_worker.py
    ``two-process``): ``dir`` holds its outputs; ``seed``, ``returncode``, ``stdout``, ``stderr``."""

    def __init__(self, root, record):
        self.dir = root
        self.__dict__.update(record)

    def check(self):
        assert self.returncode == 0, (f"the two-process run failed (exit {self.returncode}, seed {self.seed}):\n"
                                      + self.stdout[-4000:] + "\n" + self.stderr[-3000:])


@pytest.fixture(scope="session")
def two_process_run(tmp_path_factory, fresh_seed):
    """Launched once per session, also under pytest-xdist: the first worker to need it runs it under
    a file lock in the session's shared temporary directory; the others wait and read its record."""
    import fcntl
    import json

    from _multiprocess_worker import launch_two_process

    base = tmp_path_factory.getbasetemp()
    shared = base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base
    root = shared / "two_process_run"
    with open(shared / "two_process_run.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        done = root / "record.json"
        if not done.exists():
            root.mkdir(exist_ok=True)
            record = launch_two_process(root, fresh_seed("two_process_run"))
            done.write_text(json.dumps(record))
        record = json.loads(done.read_text())
    _SEEDS["two_process_run"] = record["seed"]
    print(f"two_process_run: seed {record['seed']} (re-run with {SEED_ENV}={record['seed']}), "
          f"{record['seconds']:.0f}s, in {root}")
    return TwoProcessRun(root, record)


# ----------------------------------------------------------------------------- make test-tpu
# `make test-tpu` runs the kernels' oracle tests with the Mosaic kernels on a TPU host (one process:
# the chip takes one program at a time) and records what ran where (docs/kernels.md renders it).
def pytest_addoption(parser):
    parser.addoption("--tpu-record", default=None, metavar="PATH",
                     help="make test-tpu: refuse to run without a TPU backend, then write the counts, "
                          "the failed tests, the device, jax and libtpu to PATH (JSON)")


def pytest_sessionstart(session):
    path = session.config.getoption("--tpu-record")
    session.config._tpu_record_t0 = __import__("time").time()
    if path and jax.default_backend() != "tpu":
        raise pytest.UsageError(f"--tpu-record {path}: `make test-tpu` runs on a TPU host, but JAX's backend "
                                f"is {jax.default_backend()!r} (JAX_PLATFORMS={os.environ.get('JAX_PLATFORMS')!r})")


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    path = config.getoption("--tpu-record")
    if not path:
        return
    import datetime
    import json
    import time

    from recloss import aot

    stats = terminalreporter.stats
    counts = {k: len([r for r in stats.get(k, ()) if getattr(r, "when", "call") in ("call", "setup")])
              for k in ("passed", "failed", "skipped", "error")}
    failed = sorted({r.nodeid for k in ("failed", "error") for r in stats.get(k, ())})
    device = jax.devices()[0]
    record = dict(
        date=datetime.date.today().isoformat(), device=device.device_kind, devices=jax.device_count(),
        jax=jax.__version__, libtpu=aot.libtpu_version() or "unknown", python=sys.version.split()[0],
        matmul_precision=str(jax.config.jax_default_matmul_precision),
        args=[a for a in config.invocation_params.args if not str(a).startswith("--tpu-record")],
        seconds=round(time.time() - config._tpu_record_t0, 1), exitstatus=int(exitstatus),
        counts=counts, failed=failed)
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as f:
        json.dump(record, f, indent=1)
        f.write("\n")
    terminalreporter.write_line(f"test-tpu record: {path} ({counts})")
