"""The cost table of docs/sharding.md (`tools.cost_figures`): the collectives' byte count read from
optimized HLO, the per-chip shapes, and the committed record against the pod records it must agree with."""

import json
import math

import pytest

from tools import cost_figures as cf, cost_table, figures

pytestmark = pytest.mark.tier1

RECORD = figures.FIGURES_DIR / "cost" / "v5e-256.json"

# An optimized module in XLA:TPU's spellings: a mesh-named group, an iota group, an explicit group; one
# async all-gather split into two pieces sharing channel 7; an all-reduce in a while body run 3 times; a
# collective-permute; and a collective over a group of one, which moves nothing.
HLO = """HloModule jit_step

%piece.1 (p: f32[2,4]) -> f32[8,4] {
  %p = f32[2,4]{1,0} parameter(0)
  ROOT %all-gather.1 = f32[8,4]{1,0:T(8,128)} all-gather(%p), channel_id=7, replica_groups=mesh['axis_0'=4,'axis_1'=2] {'axis_0'}, dimensions={0}
}

%piece.2 (p: f32[2,4]) -> f32[8,4] {
  %p = f32[2,4]{1,0} parameter(0)
  ROOT %all-gather.2 = f32[8,4]{1,0:T(8,128)} all-gather(%p), channel_id=7, replica_groups=mesh['axis_0'=4,'axis_1'=2] {'axis_0'}, dimensions={0}
}

%body (t: (s32[], bf16[16])) -> (s32[], bf16[16]) {
  %t = (s32[], bf16[16]) parameter(0)
  %x = bf16[16]{0} get-tuple-element(%t), index=1
  %ar = bf16[16]{0} all-reduce(%x), channel_id=9, replica_groups=[4,2]<=[8], to_apply=%add
  ROOT %o = (s32[], bf16[16]) tuple(%i, %ar)
}

ENTRY %main (a: f32[2,4], b: bf16[16], c: f32[6]) -> f32[3] {
  %a = f32[2,4]{1,0} parameter(0)
  %s1 = f32[8,4]{1,0} call(%a), to_apply=%piece.1
  %s2 = f32[8,4]{1,0} call(%a), to_apply=%piece.2
  %w = (s32[], bf16[16]) while(%init), condition=%cond, body=%body, backend_config={"known_trip_count":{"n":"3"}}
  %rs = f32[3]{0} reduce-scatter(%c), channel_id=11, replica_groups={{0,1},{2,3},{4,5},{6,7}}, dimensions={0}, to_apply=%add
  %cp = f32[6]{0} collective-permute(%c), channel_id=12, source_target_pairs={{0,1},{1,0}}
  ROOT %one = f32[3]{0} all-reduce(%rs), channel_id=13, replica_groups={{0},{1},{2},{3},{4},{5},{6},{7}}, to_apply=%add
}
"""


def test_collective_bytes_counts_each_collective_once_and_loops_by_their_trips():
    got = cf.collective_bytes(HLO, devices=8)
    assert got == {
        "all-gather": 8 * 4 * 4 * 3 / 4,              # one logical all-gather over 4 chips: R·(n−1)/n
        "all-reduce": 3 * 2 * (16 * 2) * (2 - 1) / 2,  # ×3 trips, a ring over 2: 2·R·(n−1)/n
        "reduce-scatter": 3 * 4 * (2 - 1),             # R·(n−1)
        "collective-permute": 6 * 4,
    }, got


def test_per_chip_shape_is_the_step_s():
    """M = the global batch's rows (every chip gets them over the vocab axis); V/256 rows of the table
    padded to 256 × 128, as `recloss.padded_vocab_size` pads it on the slice's 256 table shards."""
    shape = cf.per_chip(cf.config(10**9, "exact"))
    assert shape == dict(M=1024 * 256, V_chip=1_000_013_824 // 256, D=256, L=8, B=1024, N=256)
    assert cf.per_chip(cf.config(10**6, "exact"))["V_chip"] == 3968


def test_the_record_is_complete_and_agrees_with_the_pod_record_of_its_stack():
    """Every (V, loss) row, chip times for each; the exact 10^9 row's HBM is the billion-item pod row's
    (the same step compiled by two commands, to the byte); the step estimate is the sum of its parts; the table renders."""
    payload = json.loads(RECORD.read_text())
    assert [(r["V"], r["loss"]) for r in payload["rows"]] == [(v, l) for v in cf.VOCABS for l in cf.LOSSES]
    parts = {(r["V"], r["part"]) for r in payload["chip"]["rows"]}
    assert parts == {(v, p) for v in cf.VOCABS for p in (*cf.LOSSES, "optimizer")}
    assert all(r["finite"] for r in payload["chip"]["rows"])
    pod = json.loads((figures.POD_DIR / f"{figures.stack_id(payload['stack'])}.json").read_text())
    billion = [r for r in pod["rows"] if "vocab_size=1000000000" in r["overrides"]
               and "item_table_dtype=bfloat16" in r["overrides"]]   # configs/sasrec_billion.yml spelled out
    assert len(billion) == 1
    exact = next(r for r in payload["rows"] if r["V"] == 10**9 and r["loss"] == "exact")
    assert exact["hbm_bytes"] == billion[0]["hbm_bytes"]
    for row in payload["rows"]:
        est = cost_table.estimate(payload, row)
        assert math.isclose(est["step"], est["loss"] + est["optimizer"] + est["ici"])
        assert row["xla_hbm_bytes"] <= 14 * 2**30 and row["chips_per_host"] == 4
    text = figures.render_chip_record("cost-v5e-256")
    assert text.count("\n| 10^") == len(payload["rows"]) and cost_table._ms(cost_table.estimate(payload, exact)["loss"]) in text
