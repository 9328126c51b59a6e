"""recloss.aot: TPU topology names, and the largest buffers of a compiled program from XLA's buffer assignment.

On CPU: a program is compiled with the dump option and the values live at its memory peak (its
arguments and a sort's temporary) are found with their sizes, shapes and the JAX op that made them.
XLA:TPU's dump (argument paths in the parameters' metadata, memory spaces other than HBM in the
buffer assignment) is checked on files written here in its format.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest

from recloss import aot

pytestmark = pytest.mark.tier1


def test_cpu_program_peak_arguments_and_temporaries(tmp_path, rng):
    m, d, n = 384, 128, 640                     # a [m, d] f32, b [d, n] f32, a @ b [m, n] sorted
    a = jnp.asarray(rng.normal(size=(m, d)), jnp.float32)
    b = jnp.asarray(rng.normal(size=(d, n)), jnp.float32)
    lowered = jax.jit(lambda a, b: jnp.sort(a @ b, axis=0)[:4]).lower(a, b)
    compiled = lowered.compile(compiler_options=aot.dump_options(str(tmp_path)))
    peak = aot.read(str(tmp_path))

    args = sorted((x for x in peak.buffers if x.kind == "argument"), key=lambda x: x.size)
    assert [(x.size, x.shape) for x in args] == [(m * d * 4, f"f32[{m},{d}]"), (d * n * 4, f"f32[{d},{n}]")]
    assert peak.bytes_of("argument") == (m * d + d * n) * 4
    assert peak.total == sum(x.size for x in peak.buffers) and 0 <= peak.step <= peak.steps
    assert [x.size for x in peak.buffers] == sorted((x.size for x in peak.buffers), reverse=True)
    # The product [m, n] (or the sort working on it) is live at the peak, and its op is named.
    temps = [x for x in peak.buffers if x.kind == "temporary"]
    assert temps and temps[0].size >= m * n * 4, [x.describe() for x in peak.buffers]
    assert any("sort" in x.op_name or "dot_general" in x.op_name for x in temps[:2])
    # XLA's own count of the live set is no more than what memory_analysis reports.
    ma = compiled.memory_analysis()
    assert peak.total <= ma.argument_size_in_bytes + ma.output_size_in_bytes + ma.temp_size_in_bytes
    text = aot.report(peak, top=3)
    assert text.splitlines()[0].startswith("largest buffers at the memory peak (")
    assert len(text.splitlines()) == 4 and f"f32[{d},{n}]" in text


LIVE_RANGE = """HloLiveRange (max 20):
  InstructionSequence:
    0:p.0
    1:p.1
  BufferLiveRange:
    p.0{}:0-20
    p.1{}:1-20
  Live ranges at 7 (peak):
    gather_fusion{}: 2097152 bytes (cumulative: 2097152 bytes)
    p.1{}: 1048576 bytes (cumulative: 3145728 bytes)
    p.0{}: 524288 bytes (cumulative: 3670016 bytes)
    copy-start.3{0}: 4096 bytes (cumulative: 3674112 bytes)
  Stack trace breakdown for peak usage: 3 674 112 bytes
    main.1 (100.0%, total: 3 674 112 bytes)
"""
ASSIGNMENT = """BufferAssignment:
allocation 0: size 512, thread-local:
allocation 1: size 1048576, parameter 1, shape |f32[256,1024]| at ShapeIndex {}, maybe-live-out:
allocation 4: size 3145728, preallocated-temp:
allocation 5: size 1052672, color 1, preallocated-temp:
"""
HLO = """HloModule m
ENTRY %main (p.0: f32[512,256], p.1: f32[256,1024]) -> f32[1024] {
  %p.0 = f32[512,256]{1,0:T(8,128)} parameter(0), metadata={op_name="state[\\'params\\'][\\'w\\']"}
  %p.1 = f32[256,1024]{1,0:T(8,128)} parameter(1), metadata={op_name="batch"}
  %gather_fusion = f32[2048,256]{1,0:T(8,128)} fusion(%p.1), kind=kLoop, metadata={op_name="jit(step)/jvp()/gather"}
  %copy-start.3 = (f32[1024]{0:T(1024)S(1)}, f32[1024]{0:T(1024)}, u32[]{:S(2)}) copy-start(%p.1)
}
"""


def test_tpu_style_dump_lists_the_peak_with_owners(tmp_path):
    stem = "module_0003.jit_step.cl_1.after_optimizations"
    (tmp_path / f"{stem}-live-range.txt").write_text(LIVE_RANGE)
    (tmp_path / f"{stem}-buffer-assignment.txt").write_text(ASSIGNMENT)
    (tmp_path / f"{stem}.txt").write_text(HLO)
    peak = aot.read(str(tmp_path))
    assert (peak.step, peak.steps, peak.total) == (7, 20, 3674112)
    # Only the default memory space's temporaries count toward what XLA reserves (not color 1).
    assert peak.temp_allocation == 3145728
    assert [(x.kind, x.name, x.size) for x in peak.buffers] == [
        ("temporary", "gather_fusion", 2097152), ("argument", "p.1", 1048576), ("argument", "p.0", 524288),
        ("temporary", "copy-start.3{0}", 4096)]
    top = peak.buffers[0]
    assert (top.opcode, top.shape, top.op_name) == ("fusion", "f32[2048,256]", "jit(step)/jvp()/gather")
    line = top.describe()
    assert line.split()[:5] == ["2.00", "MiB", "temporary", "f32[2048,256]", "fusion"] and "jvp()/gather" in line
    assert peak.buffers[2].describe().endswith("argument state['params']['w']: f32[512,256]")
    assert peak.bytes_of("argument") == 1572864 and peak.bytes_of("temporary") == 2101248
    assert "XLA reserves 3.00 MiB for the temporaries" in aot.report(peak).splitlines()[0]


def test_missing_dump_names_the_option(tmp_path):
    with pytest.raises(FileNotFoundError, match="dump_options"):
        aot.read(str(tmp_path))
    (tmp_path / "m.after_optimizations-live-range.txt").write_text("HloLiveRange (max 3):\n")
    with pytest.raises(ValueError, match="no 'Live ranges at"):
        aot.read(str(tmp_path))


def test_topology_names():
    assert aot.topology_name("v6e-8") == "v6e:2x4"
    assert aot.topology_name("v5litepod-16") == "v5e:4x4"
    assert aot.topology_name("v5p-16") == "v5p:2x2x2"
    assert aot.topology_name("v4-8") == "v4:2x2x1"
    assert aot.topology_name("v6e:2x2") == "v6e:2x2"
    with pytest.raises(aot.TopologyError, match="'tpu8' is not a known TPU name"):
        aot.topology_name("tpu8")
    with pytest.raises(aot.TopologyError, match="no v6e topology with 12 chips"):
        aot.topology_name("v6e-12")
    with pytest.raises(aot.TopologyError, match="v5p sizes count TensorCores"):
        aot.topology_name("v5p-7")
