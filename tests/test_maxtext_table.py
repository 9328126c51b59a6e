"""tools.maxtext_table: parsing a compile's output and the table it renders (no MaxText needed)."""

import argparse
import re

import pytest

from tools import maxtext_table as mt

pytestmark = pytest.mark.tier1


def test_parse_output_ok_oom_and_error():
    ok = mt.parse_output("I1204 noise\nrecloss-maxtext-compile: per-chip HBM 5.214 GiB (temporaries 2.118 GiB), "
                         "compiled in 41.3 s; loss=cutce_pallas\n", 0)
    assert ok == {"status": "ok", "total_gib": 5.214, "temp_gib": 2.118, "seconds": 41.3}
    auto = mt.parse_output("recloss: loss_fsdp_gather=auto: 'rows' (fsdp 4, ...)\nrecloss-maxtext-compile: per-chip "
                           "HBM 5.214 GiB (temporaries 2.118 GiB), compiled in 41.3 s; loss=cutce_pallas\n", 0)
    assert auto == dict(ok, gather="rows")
    xla = mt.parse_output("recloss-maxtext-compile: per-chip HBM 5.214 GiB (temporaries 2.118 GiB; XLA's count "
                          "4.750 GiB), compiled in 41.3 s; loss=cutce_pallas\n", 0)
    assert xla == dict(ok, xla_gib=4.75)
    new = ("jax.errors.JaxRuntimeError: RESOURCE_EXHAUSTED: E1000: CompileTimeHbmOom: Ran out of memory on HBM, "
           "the total memory required for HLO temporaries (34.96G) exceeds available HBM (31.24G).")
    assert mt.parse_output(new, 1) == {"status": "oom", "used_gib": 34.96, "capacity_gib": 31.24}
    old = "RESOURCE_EXHAUSTED: Ran out of memory in memory space hbm. Used 41.2G of 31.25G hbm."
    assert mt.parse_output(old, 1) == {"status": "oom", "used_gib": 41.2, "capacity_gib": 31.25}
    err = mt.parse_output("I1204 x\nTraceback\nValueError: bad block\n", 1)
    assert err["status"] == "error" and "ValueError: bad block" in err["message"] and "I1204" not in err["message"]


def test_points_and_table():
    assert mt.parse_point("8x4096") == (8, 4096)
    for bad in ("8*4096", "0x4096", "x"):
        with pytest.raises(argparse.ArgumentTypeError, match=re.escape(repr(bad))):
            mt.parse_point(bad)
    ok = lambda t: {"status": "ok", "total_gib": t, "temp_gib": t / 2, "seconds": 30.0}
    cells = {mt.cell_key("m", "v6e-8", (4, 2048), 2, "maxtext"): {"status": "oom", "used_gib": 40.0},
             mt.cell_key("m", "v6e-8", (4, 2048), 2, "tiling4"): ok(10.0),
             mt.cell_key("m", "v6e-8", (4, 2048), 2, "tiling8-ag"): ok(8.0),
             mt.cell_key("m", "v6e-8", (4, 2048), 2, "cutce_pallas"): ok(6.0)}
    text = mt.format_table({"cells": cells, "layers": 2})
    assert "OOM (40.0 GiB temp.)" in text and "0.75 (cutce_pallas vs tiling8-ag)" in text and "| m | v6e-8 | 4 × 2048 | 2 |" in text
    assert mt.best_tiling({k.rpartition("|")[2]: v for k, v in cells.items()}) == ("tiling8-ag", 8.0)
    # The plugin's defaults, where recorded, are the column the ratio is of; its cell shows the mode 'auto' picked.
    cells[mt.cell_key("m", "v6e-8", (4, 2048), 2, "cutce_pallas-auto")] = dict(ok(4.0), gather="rows")
    text = mt.format_table({"cells": cells, "layers": 2})
    assert "4.00 / 2.00 · 30 s (rows)" in text and "0.50 (cutce_pallas-auto vs tiling8-ag)" in text
    # XLA's own count, where a cell recorded it, beside memory_analysis's, and the ratio by it (its own best).
    cells[mt.cell_key("m", "v6e-8", (4, 2048), 2, "cutce_pallas-auto")]["xla_gib"] = 3.0
    cells[mt.cell_key("m", "v6e-8", (4, 2048), 2, "tiling4")]["xla_gib"] = 5.0
    text = mt.format_table({"cells": cells, "layers": 2})
    assert "4.00 / 2.00 · XLA 3.00 · 30 s (rows)" in text and "by XLA's count 0.60 (vs tiling4)" in text


def test_headline_is_default_best_tiling_and_ours_per_point():
    ok = lambda t: {"status": "ok", "total_gib": t, "temp_gib": t / 2, "seconds": 30.0}
    cells = {mt.cell_key("m", "v6e-8", (8, 4096), 2, "maxtext"): {"status": "oom"},
             mt.cell_key("m", "v6e-8", (8, 4096), 2, "tiling2"): ok(12.0),
             mt.cell_key("m", "v6e-8", (8, 4096), 2, "tiling4-ag"): ok(9.0),
             mt.cell_key("m", "v6e-8", (8, 4096), 2, "cutce"): ok(1.0),       # not a MaxText column
             mt.cell_key("m", "v6e-8", (8, 4096), 2, "cutce_pallas"): ok(7.2),
             mt.cell_key("m", "v6e-8", (4, 2048), None, "cutce_pallas"): ok(3.0)}  # full depth: not a headline row
    text = mt.format_headline({"cells": cells, "layers": 2, "stack": {"jax": "0.12"}})
    rows = [line for line in text.splitlines() if line.startswith("| m ")]
    assert rows == ["| m | v6e-8 | 8 × 4096 | OOM | 9.00 (tiling4-ag) | 7.20 | 0.80 |"], text
    assert "jax 0.12, 2 decoder layers" in text


def test_largest_fitting_bisects_a_prefix():
    ladder = mt.LADDER
    for n_fit in range(len(ladder) + 1):
        probed = []

        def fits(point):
            probed.append(point)
            return ladder.index(point) < n_fit

        assert mt.largest_fitting(ladder, fits) == (ladder[n_fit - 1] if n_fit else None)
        assert len(probed) <= 4 and len(set(probed)) == len(probed), (n_fit, probed)
