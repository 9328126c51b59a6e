"""The optimized HLO of loss+grad for a fixed matrix of cases, normalised so that two versions of the
library can be compared for a refactor that must not change the program.

    python -m tools.hlo dump DIR      # one .hlo file per case, and the time each took
    python -m tools.hlo diff A B      # exit 1 naming each case whose program differs

Cases: {cutbce, cutbce_pallas, cutce, cutce_pallas, dense_bce, dense_ce, sampled_softmax} × {defaults;
bias + options; reduction='none'} × {CPU one device, CPU (2,2,2) data/fsdp/vocab, CPU (1,8,1) fsdp ring,
CPU (1,8,1) fsdp rows gather, one v6e chip (libtpu AOT, skipped without libtpu)}, each strategy on the
fsdp gathers it takes (the dense and sampled ones: 'once'). Inputs are abstract (ShapeDtypeStruct) with
odd sizes: M = 96 rows, D = 40, 1,024 table rows of which 1,000 are the vocabulary in the options cases;
sampled_softmax draws its negatives from a fixed key.

Normalised means: instruction and computation names renumbered by first appearance, ``metadata``,
the stack-frame tables and a kernel's ``debug_locations`` (op names, source files and lines) dropped,
and each Mosaic kernel's serialized MLIR printed as text without its locations (`kernel_text`).
"""

from __future__ import annotations

import argparse
import difflib
import os
import re
import sys
import time

if __name__ == "__main__":   # before jax loads: eight CPU devices for the meshes, no TPU probing
    os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
    os.environ.setdefault("JAX_PLATFORMS", "cpu")

from recloss import aot

STRATEGIES = ("cutbce", "cutbce_pallas", "cutce", "cutce_pallas", "dense_bce", "dense_ce", "sampled_softmax")
VARIANTS = ("defaults", "options", "rows")
# (CPU mesh shape, fsdp_gather) of the sharded cases; a strategy runs those whose gather it takes.
SHARDED = {"cpu222": ((2, 2, 2), "once"), "ring181": ((1, 8, 1), "ring"), "rows181": ((1, 8, 1), "rows")}
MESHES = ("cpu1", "cpu222", "ring181", "rows181", "v6e1")
M, D, V, VOCAB = 96, 40, 1024, 1000

_OPTIONS = {
    "bce": dict(label_smoothing=0.1, pos_weight=2.0, focal_gamma=2.0, focal_alpha=0.25, threshold=0.5),
    "softmax": dict(label_smoothing=0.1, z_loss=1e-4, temperature=0.7),
    "sampled": dict(num_negatives=64, temperature=0.7, remove_accidental_hits=False),
}


def _case_args(strategy: str, variant: str):
    import recloss

    objective = recloss.get_strategy(strategy).objective
    if variant == "defaults":
        return objective, {}, False
    if variant == "options":
        return objective, dict(_OPTIONS[objective], vocab_size=VOCAB), True
    return objective, dict(reduction="none", vocab_size=VOCAB), True


def compile_case(strategy: str, variant: str, mesh_name: str):
    """The compiled ``jit(grad)`` of Σ loss over (hidden, table[, bias]) for one case."""
    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

    import recloss

    objective, options, with_bias = _case_args(strategy, variant)
    entry = dict(bce=recloss.bce_loss, softmax=recloss.softmax_loss, sampled=recloss.sampled_loss)[objective]
    inputs = dict(key=jax.random.key(0)) if objective == "sampled" else {}
    layout = None
    if mesh_name == "v6e1":
        mesh = aot.one_chip_mesh("v6e-8")      # under set_mesh below: Pallas strategies compile Mosaic
    elif mesh_name == "cpu1":
        mesh = Mesh(np.array(jax.devices("cpu")[:1]), ("chip",))
    else:
        shape, gather = SHARDED[mesh_name]
        mesh = Mesh(np.array(jax.devices("cpu")[:8]).reshape(shape), ("data", "fsdp", "vocab"))
        layout = recloss.MeshLayout(mesh, fsdp_gather=gather)
    rep = NamedSharding(mesh, P())
    args = [jax.ShapeDtypeStruct((M, D), jnp.float32, sharding=rep),
            jax.ShapeDtypeStruct((V, D), jnp.float32, sharding=rep),
            jax.ShapeDtypeStruct((M, 3), jnp.int32, sharding=rep)]
    if with_bias:
        args.append(jax.ShapeDtypeStruct((V,), jnp.float32, sharding=rep))

    def loss(h, e, t, *maybe_bias):
        bias = maybe_bias[0] if maybe_bias else None
        out = entry(h, e, t, None, bias, strategy=strategy, layout=layout, **inputs, **options)
        return jnp.sum(out.loss) + sum(jnp.sum(v) for v in out.metrics.values()) * 0.0

    argnums = (0, 1, 3) if with_bias else (0, 1)
    with jax.set_mesh(mesh):
        return jax.jit(jax.grad(loss, argnums=argnums)).lower(*args).compile()


_NAME = re.compile(r"%[A-Za-z_][\w.\-]*")
_METADATA = re.compile(r",?\s*metadata=\{[^{}]*\}")
_KERNEL = re.compile(r'"body":"([A-Za-z0-9+/=]+)"')
_DEBUG_LOCATIONS = re.compile(r'"debug_locations":"[A-Za-z0-9+/=]*"')   # newer jax: the kernel's locations
_PARAM = re.compile(r"(?<![%\w.])([A-Za-z_][\w.\-]*): ")
_TABLES = ("FileNames", "FunctionNames", "FileLocations", "StackFrames")


def kernel_text(body_b64: str) -> str:
    """A Mosaic kernel's serialized MLIR (base64 bytecode in the custom call's config) as text
    without locations; the size of the bytecode when it cannot be parsed here."""
    import base64

    from jax._src.lib.mlir import ir

    data = base64.b64decode(body_b64)
    ctx = ir.Context()
    ctx.allow_unregistered_dialects = True   # the kernel's ops are the versioned stable_mosaic.* ones
    try:
        from jaxlib.mosaic.python import tpu   # its attributes (#tpu.memory_space) need the dialect

        tpu.register_dialect(ctx)
        with ctx:
            return ir.Module.parse(data).operation.get_asm(enable_debug_info=False)
    except Exception as err:   # noqa: BLE001  (a reader for a comparison: say so and go on)
        return f"<kernel bytecode of {len(data)} bytes, not parsed: {type(err).__name__}>"


def normalise(text: str) -> str:
    """HLO text with names renumbered by first appearance, metadata and the stack-frame tables
    dropped, and each Mosaic kernel's payload replaced by a reference to its text (appended, without
    locations)."""
    text = _METADATA.sub("", text)
    kernels = []

    def kernel(m):
        kernels.append(kernel_text(m.group(1)))
        return f'"body":"<kernel {len(kernels) - 1}>"'

    text = _KERNEL.sub(kernel, text)
    text = _DEBUG_LOCATIONS.sub('"debug_locations":"<dropped>"', text)
    names = {}

    def rename_key(key):
        return names.setdefault(key, f"%n{len(names)}")

    def rename(m):
        return rename_key(m.group(0))

    lines, skipping = [], False
    for line in text.splitlines():
        if line.strip() in _TABLES:
            skipping = True
        if skipping:
            skipping = bool(line.strip())
            continue
        if line.startswith("HloModule"):
            line = line.split(",", 1)[-1]
        if line.rstrip().endswith("{") and "(" in line:   # a computation's header: its parameters' names
            line = _PARAM.sub(lambda m: rename_key("%" + m.group(1)) + ": ", line)
        lines.append(_NAME.sub(rename, line))
    for i, k in enumerate(kernels):
        lines += [f"Kernel {i}", k]
    return "\n".join(lines) + "\n"


def cases():
    import recloss

    for mesh in MESHES:
        for strategy in STRATEGIES:
            if mesh in SHARDED and SHARDED[mesh][1] not in recloss.get_strategy(strategy).fsdp_gathers:
                continue
            for variant in VARIANTS:
                yield strategy, variant, mesh


def dump(out_dir: str) -> int:
    import importlib.util

    os.makedirs(out_dir, exist_ok=True)
    have_tpu = importlib.util.find_spec("libtpu") is not None
    all_cases = [c for c in cases() if have_tpu or c[2] != "v6e1"]
    if not have_tpu:
        print("libtpu is not importable: the v6e1 cases are skipped", file=sys.stderr)
    start = time.perf_counter()
    for i, (strategy, variant, mesh) in enumerate(all_cases, 1):
        t0 = time.perf_counter()
        text = normalise(compile_case(strategy, variant, mesh).as_text())
        name = f"{mesh}-{strategy}-{variant}.hlo"
        with open(os.path.join(out_dir, name), "w") as f:
            f.write(text)
        print(f"[{i}/{len(all_cases)}] {name}: {len(text.splitlines())} lines, "
              f"{time.perf_counter() - t0:.1f} s", flush=True)
    print(f"{len(all_cases)} programs in {time.perf_counter() - start:.0f} s -> {out_dir}")
    return 0


def diff(a: str, b: str) -> int:
    names = sorted(set(os.listdir(a)) | set(os.listdir(b)))
    bad = 0
    for name in names:
        pa, pb = os.path.join(a, name), os.path.join(b, name)
        if not (os.path.exists(pa) and os.path.exists(pb)):
            print(f"{name}: only in {a if os.path.exists(pa) else b}")
            bad += 1
            continue
        ta, tb = open(pa).read().splitlines(), open(pb).read().splitlines()
        if ta != tb:
            bad += 1
            d = list(difflib.unified_diff(ta, tb, a, b, n=1, lineterm=""))
            print(f"{name}: DIFFERS ({sum(l.startswith(('+', '-')) for l in d) - 2} changed lines)")
            print("\n".join(d[:40]))
    print(f"{len(names) - bad} of {len(names)} programs identical")
    return 1 if bad else 0


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tools.hlo", description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="cmd", required=True)
    sub.add_parser("dump").add_argument("out_dir")
    d = sub.add_parser("diff")
    d.add_argument("a")
    d.add_argument("b")
    args = parser.parse_args(argv)
    if args.cmd == "dump":
        return dump(args.out_dir)
    return diff(args.a, args.b)


if __name__ == "__main__":
    sys.exit(main())
