"""Ahead-of-time compilation for a TPU topology, and what the compiled program holds per chip.

libtpu (``pip install 'jax[tpu]'``) describes a TPU topology and compiles for it on any machine, a
CPU host included: no TPU is needed to learn whether a step fits a chip. This module names the
topology's devices, and reads a compiled program's memory three ways:

- `memory_report`: ``compiled.memory_analysis()`` per device, MaxText's accounting (arguments +
  outputs + temporaries − aliased, in bytes);
- `hbm_bytes`: XLA's own count of the default memory space (HBM on TPU), what the TPU compiler holds
  against the chip ("the total memory required ... exceeds available HBM"); `memory_analysis` can
  count more temporaries than XLA reserves;
- `read` and `report`: the buffers live at the memory peak, largest first, each with the HLO
  instruction and the JAX operation that made it.

::

    from recloss import aot
    aot.libtpu_env()                                  # off a TPU VM: before libtpu loads
    mesh = aot.one_chip_mesh("v6e-8")                 # or Mesh(aot.topology_devices("v5e-256"), ...)
    compiled = jax.jit(step).lower(*abstract_args).compile(compiler_options=aot.dump_options(folder))
    aot.memory_report(compiled)["total"], aot.hbm_bytes(folder)
    print(aot.report(aot.read(folder), top=5))

    python -m recloss.aot DUMP_FOLDER [--top 10]      # the peak of a folder XLA dumped into

XLA writes its buffer analysis when it dumps a module (``xla_dump_to``, passed as a compile option by
`dump_options`, so no environment flag and no restart). ``<module>...-live-range.txt`` ends with the
values live at the program's memory peak ("Live ranges at S (peak):", their sizes summing to the
peak); the optimized HLO (``<module>...after_optimizations.txt``) says what each value's instruction
is and which JAX operation made it (``metadata={op_name=...}``; for an argument, its path in the
arguments, e.g. ``state['params']['item_emb']['embedding']``). A program JAX's persistent compilation
cache returns was not compiled, so nothing is dumped for it: `read` then says so.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import glob
import os
import re
from typing import Dict, List, NamedTuple, Tuple

_INSTR = re.compile(r"^\s*(?:ROOT\s+)?%?([^\s=]+) = (.+?) ([a-z][\w-]*)\(")
_OP_NAME = re.compile(r'op_name="([^"]*)"')
_PEAK = re.compile(r"^\s*Live ranges at (\d+) \(peak\):")
_LIVE = re.compile(r"^\s+([^\s{]+)(\{[^}]*\})?: (\d+) bytes")
_STEPS = re.compile(r"HloLiveRange \(max (\d+)\)")
_LIVE_RANGE = "after_optimizations-live-range.txt"


# ----------------------------------------------------------------------------- the topology
class TopologyError(ValueError):
    """A TPU topology name this module does not know, or libtpu cannot describe."""


def libtpu_env() -> None:
    """Sets (setdefault) what libtpu needs to describe and compile for a topology without a TPU.

    Call before libtpu is loaded. Other processes (test workers, a second benchmark) may hold
    libtpu's lockfile; compiling for a topology needs no exclusive access to a TPU. Off a TPU VM
    (TPU_SKIP_MDS_QUERY, which ``import jax`` sets when no TPU chip is attached) libtpu cannot ask
    the metadata server for the workers: it stores the sentence "WARNING: could not determine TPU
    worker hostnames ..." as TPU_WORKER_HOSTNAMES and logs "E0000 ... unexpected worker hostname"
    (and "Failed to find host bounds for accelerator type"). Compiling needs no workers, so this
    host is named the only one. A TPU VM (no TPU_SKIP_MDS_QUERY) or a pod that lists its workers
    (TPU_WORKER_HOSTNAMES / TPU_PROCESS_ADDRESSES, as on GKE) is left as it is.
    """
    import jax  # noqa: F401  (its cloud_tpu_init sets TPU_SKIP_MDS_QUERY on a machine without a TPU)

    os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
    env = os.environ
    if env.get("TPU_SKIP_MDS_QUERY") is not None and not env.get("TPU_WORKER_HOSTNAMES") \
            and not env.get("TPU_PROCESS_ADDRESSES"):
        env["TPU_WORKER_HOSTNAMES"] = "localhost"   # unset or empty here
        env.setdefault("TPU_WORKER_ID", "0")
        env.setdefault("TPU_HOST_BOUNDS", "1,1,1")


def libtpu_version():
    """The installed libtpu's version (what the AOT figures of a program depend on), or None."""
    import importlib.metadata as md

    for dist in ("libtpu", "libtpu-nightly"):
        try:
            return md.version(dist)
        except md.PackageNotFoundError:
            continue
    return None


# Chips of a slice -> its libtpu shape. Cloud names v6e and v5e slices by chips, v5p and v4 by
# TensorCores (two a chip): v5p-8 is four chips.
_TOPOLOGIES_2D = {1: "1x1", 4: "2x2", 8: "2x4", 16: "4x4", 32: "4x8", 64: "8x8", 128: "8x16", 256: "16x16"}
_TOPOLOGIES_3D = {4: "2x2x1", 8: "2x2x2", 16: "2x2x4", 32: "2x4x4", 64: "4x4x4", 128: "4x4x8", 256: "4x8x8",
                  512: "8x8x8"}


def topology_name(name: str) -> str:
    """A Cloud TPU slice name (MaxText's ``compile_topology``) as libtpu's topology name.

    ``v6e-8`` -> ``v6e:2x4``; ``v5e-16`` (alias ``v5litepod-16``) -> ``v5e:4x4``;
    ``v5p-16`` / ``v4-16`` (TensorCore counts, 2 per chip) -> ``v5p:2x2x2``. Names already in
    ``gen:AxB[xC]`` form pass through. Raises `TopologyError` naming the value."""
    name = name.strip().lower()
    if re.fullmatch(r"v[0-9a-z]+:\d+(x\d+){1,2}", name):
        return name
    m = re.fullmatch(r"(v6e|v5e|v5litepod|v5p|v4)-(\d+)", name)
    if not m:
        raise TopologyError(f"{name!r} is not a known TPU name; use e.g. v6e-8, v5e-8, v5p-8, v4-8 or a "
                            "libtpu topology such as v6e:2x4")
    gen, count = m.group(1), int(m.group(2))
    gen = "v5e" if gen == "v5litepod" else gen
    if gen in ("v6e", "v5e"):
        table, chips = _TOPOLOGIES_2D, count
    else:
        if count % 2:
            raise TopologyError(f"{name!r}: {gen} sizes count TensorCores (2 per chip); use an even number")
        table, chips = _TOPOLOGIES_3D, count // 2
    if chips not in table:
        raise TopologyError(f"{name!r}: no {gen} topology with {chips} chips is known; known chip counts: "
                            f"{sorted(table)} (or pass a libtpu name like {gen}:2x4)")
    return f"{gen}:{table[chips]}"


@functools.lru_cache(maxsize=None)
def topology_devices(name: str, num_slices: int = 1) -> tuple:
    """The devices of TPU topology ``name`` (`topology_name`'s names), ``num_slices`` slices of it,
    as libtpu describes them (no TPU needed). Calls `libtpu_env` first."""
    libtpu_env()
    from jax.experimental import topologies

    topo = topology_name(name)
    dims = [int(x) for x in topo.split(":")[1].split("x")]
    bounds = tuple(min(d, 2) for d in dims[:2]) + (1,)
    try:
        desc = topologies.get_topology_desc(platform="tpu", topology_name=topo, chip_config_name="default",
                                            chips_per_host_bounds=bounds, num_slices=num_slices)
    except Exception as err:
        raise TopologyError(f"libtpu could not describe topology {topo!r} (from {name!r}); is libtpu "
                            f"(jax[tpu]) installed? ({err})") from err
    return tuple(desc.devices)


def one_chip_mesh(name: str):
    """A one-device `jax.sharding.Mesh` (axis 'chip') on the first chip of topology ``name``:
    compile under ``jax.set_mesh`` of it for one chip's memory."""
    import numpy as np
    from jax.sharding import Mesh

    return Mesh(np.array(topology_devices(name)[:1]), ("chip",))


# ----------------------------------------------------------------------------- memory
def memory_report(compiled) -> Dict[str, float]:
    """Per-device bytes of a compiled program (MaxText's accounting: args + outputs + temps − aliases)."""
    ma = compiled.memory_analysis()
    if ma is None:
        return {}
    if isinstance(ma, (list, tuple)):
        ma = ma[0]
    get = lambda name: float(getattr(ma, name, 0) or 0)
    out = {"argument": get("argument_size_in_bytes"), "output": get("output_size_in_bytes"),
           "temp": get("temp_size_in_bytes"), "alias": get("alias_size_in_bytes"),
           "code": get("generated_code_size_in_bytes")}
    out["total"] = out["argument"] + out["output"] + out["temp"] - out["alias"]
    return out


def format_memory(rep: Dict[str, float]) -> str:
    """`memory_report` in one line of GiB."""
    if not rep:
        return "memory analysis unavailable on this backend"
    g = lambda x: f"{x / 2**30:.3f} GiB"
    return (f"total {g(rep['total'])} = arguments {g(rep['argument'])} + outputs {g(rep['output'])} "
            f"+ temporaries {g(rep['temp'])} - aliased {g(rep['alias'])} (code {g(rep['code'])})")


def dump_options(folder: str) -> Dict[str, str]:
    """Compile options (``lowered.compile(compiler_options=...)``) that make XLA dump the compiled
    module and its buffer analysis into ``folder``."""
    return {"xla_dump_to": str(folder)}


@dataclasses.dataclass(frozen=True)
class Buffer:
    """One value live at the peak: ``kind`` 'argument' or 'temporary', its bytes, the instruction
    (name, opcode, shape without layout) and ``op_name``: the JAX operation that made it, or for an
    argument its path in the arguments."""
    kind: str
    size: int
    name: str
    opcode: str
    shape: str
    op_name: str
    also: Tuple[str, ...] = ()     # other values live at the peak in the same buffer (aliases)

    def describe(self, width: int = 110) -> str:
        """One line: size, kind, the argument's path or the instruction's shape and opcode, and the
        JAX op that made a temporary (trimmed from the left to ``width``)."""
        if self.kind == "argument":
            return f"{_human(self.size):>10}  argument {(self.op_name or self.name).replace(chr(92) + chr(39), chr(39))}: {self.shape}"
        line = f"{_human(self.size):>10}  temporary {self.shape} {self.opcode or self.name}"
        if self.also:
            line += f" (+{len(self.also)} in place)"
        if self.op_name:
            line += f"  <- {_trim(self.op_name, max(20, width - len(line) - 4))}"
        return line


class Peak(NamedTuple):
    """`read`'s result: the values live at the peak, largest first; the peak's bytes; the step of
    the schedule it falls on and the schedule's length; ``temp_allocation``: the bytes XLA reserves
    for the temporaries (default memory space; from the buffer assignment, -1 if absent), which is
    what must fit beside the arguments: more than the temporaries live at the peak when their
    packing leaves holes."""
    buffers: List[Buffer]
    total: int
    step: int
    steps: int
    temp_allocation: int = -1
    hbm: int = -1      # XLA's bytes of the default memory space (`hbm_bytes`), -1 if not reported

    def bytes_of(self, kind: str) -> int:
        return sum(b.size for b in self.buffers if b.kind == kind)


def _human(n: float) -> str:
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= scale:
            return f"{n / scale:.2f} {unit}"
    return f"{int(n)} B"


def _trim(text: str, n: int) -> str:
    return text if len(text) <= n else "…" + text[-(n - 1):]


def _module_files(folder: str) -> Tuple[str, str]:
    """(live ranges, optimized HLO) of the largest module XLA dumped into ``folder``."""
    found = glob.glob(os.path.join(folder, "*" + _LIVE_RANGE))
    if not found:
        raise FileNotFoundError(f"no '*{_LIVE_RANGE}' in {folder!r}: compile with "
                                f"compiler_options=recloss.aot.dump_options({folder!r}) first (a program "
                                "JAX's persistent compilation cache returns is not compiled, so not dumped)")
    path = max(found, key=os.path.getsize)
    return path, path[: -len("-live-range.txt")] + ".txt"


def _instructions(hlo_path: str) -> Dict[str, Tuple[str, str, str]]:
    """{instruction name: (opcode, shape without layout, op_name)} of an optimized HLO text file."""
    out: Dict[str, Tuple[str, str, str]] = {}
    if os.path.exists(hlo_path):
        with open(hlo_path) as f:
            for line in f:
                m = _INSTR.match(line)
                if m:
                    op = _OP_NAME.search(line)
                    out[m.group(1)] = (m.group(3), re.sub(r"\{[^}]*\}", "", m.group(2)).strip(),
                                       op.group(1) if op else "")
    return out


def read(folder: str) -> Peak:
    """The values live at the memory peak of the module XLA dumped into ``folder``, largest first."""
    live_range, hlo = _module_files(folder)
    instr = _instructions(hlo)
    out: List[Buffer] = []
    step = steps = -1
    with open(live_range) as f:
        lines = iter(f)
        for line in lines:
            m = _STEPS.search(line)
            if m:
                steps = int(m.group(1))
            m = _PEAK.match(line)
            if m:
                step = int(m.group(1))
                break
        for line in lines:
            v = _LIVE.match(line)
            if not v:
                break
            opcode, shape, op_name = instr.get(v.group(1), ("", "", ""))
            kind = "argument" if opcode == "parameter" else "temporary"
            index = "" if v.group(2) in (None, "{}") else v.group(2)
            out.append(Buffer(kind, int(v.group(3)), v.group(1) + index, opcode, shape, op_name))
    if step < 0:
        raise ValueError(f"{live_range} has no 'Live ranges at ... (peak)' section")
    temp_bytes, places = _assignment(live_range)
    out = _merge_aliases(out, places)
    out.sort(key=lambda b: -b.size)
    return Peak(out, sum(b.size for b in out), step, steps, temp_bytes, _default_space_bytes(live_range))


_DEFAULT_SPACE = re.compile(r"^Memory Space: default \(color=0\)\s*\nTotal bytes: (\d+)", re.M)


def hbm_bytes(folder: str) -> int:
    """XLA's own count of the default memory space (HBM on TPU) of the module dumped into ``folder``:
    arguments, outputs and the temporaries its buffer assignment reserves, from
    ``<module>...-memory-usage-report.txt``; -1 if XLA wrote none.

    This is what the TPU compiler holds against the chip ("the total memory required ... exceeds
    available HBM"). `compiled.memory_analysis()` usually agrees, but can count more temporaries than
    are reserved: loss+grad of dense_bce at B=8, N=256, D=256, V=913,408 is 22.65 GiB by
    memory_analysis and 15.68 here, and it compiled and ran on a 15.75 GiB v5e chip.
    """
    return _default_space_bytes(_module_files(folder)[0])


def _default_space_bytes(live_range: str) -> int:
    """`hbm_bytes` from the memory-usage report beside ``live_range``."""
    path = live_range[: -len("-live-range.txt")] + "-memory-usage-report.txt"
    if not os.path.exists(path):
        return -1
    with open(path) as f:
        m = _DEFAULT_SPACE.search(f.read())
    return int(m.group(1)) if m else -1


def _merge_aliases(values: List[Buffer], places: Dict[str, Tuple[int, int]]) -> List[Buffer]:
    """One `Buffer` per (allocation, offset): values XLA placed in the same buffer (an op written
    over its operand) count once, under the one with a JAX op name."""
    groups: Dict[object, List[Buffer]] = {}
    for b in values:
        groups.setdefault(places.get(b.name, b.name), []).append(b)
    out = []
    for group in groups.values():
        main = next((b for b in group if b.op_name), group[0])
        rest = tuple(b.name for b in group if b is not main)
        out.append(dataclasses.replace(main, size=max(b.size for b in group), also=rest))
    return out


def _assignment(live_range: str) -> Tuple[int, Dict[str, Tuple[int, int]]]:
    """(bytes of the default memory space's preallocated temporaries, {value: (allocation, offset)})
    from the buffer assignment beside ``live_range`` ((-1, {}) if there is none)."""
    path = live_range[: -len("-live-range.txt")] + "-buffer-assignment.txt"
    if not os.path.exists(path):
        return -1, {}
    total, places, alloc = 0, {}, -1
    with open(path) as f:
        for line in f:
            m = re.match(r"^allocation (\d+): size (\d+)(.*):$", line)
            if m:
                alloc = int(m.group(1))
                if "preallocated-temp" in m.group(3) and not re.search(r"\bcolor [1-9]", m.group(3)):
                    total += int(m.group(2))
                continue
            v = re.match(r"^ value: <\d+ (\S+) @\d+> \(size=\d+,offset=(\d+)\)", line)
            if v:
                places[v.group(1).replace("{}", "")] = (alloc, int(v.group(2)))
    return total, places


def report(peak: Peak, top: int = 5) -> str:
    """The ``top`` largest buffers live at the peak, one line each, under a line of totals."""
    head = (f"largest buffers at the memory peak ({_human(peak.total)} per chip: arguments "
            f"{_human(peak.bytes_of('argument'))}, temporaries {_human(peak.bytes_of('temporary'))}; "
            f"step {peak.step} of {peak.steps}")
    if peak.temp_allocation >= 0:
        head += f"; XLA reserves {_human(peak.temp_allocation)} for the temporaries"
    head += "):"
    return "\n".join([head] + ["  " + b.describe() for b in peak.buffers[:top]])


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m recloss.aot", description=__doc__.split("\n\n")[0])
    p.add_argument("folder", help="a folder XLA dumped a compiled module into (xla_dump_to)")
    p.add_argument("--top", type=int, default=10, help="how many buffers to list (default 10)")
    args = p.parse_args(argv)
    print(report(read(args.folder), args.top))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
