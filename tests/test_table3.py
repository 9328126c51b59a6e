"""recloss-train --table3 (recloss_plugins.sasrec.speed): its grid, its parsing of the trainer's log, the
parts check, the record's merge, and one tiny row end to end on CPU."""

import json
import types

import jax
import pytest

from recloss_plugins.sasrec import speed

@pytest.mark.tier1
def test_the_grid_is_table_iii_and_the_small_vocabulary():
    rows = speed.paper_rows()
    keys = [r.key for r in rows]
    assert len(keys) == len(set(keys)) == 2 * 2 * 4 * 2 + 4 * 2
    assert {(r.batch, r.seq) for r in rows if r.vocab == speed.PAPER_V} == {(8, 256), (8, 512), (16, 256), (16, 512)}
    assert {r.loss for r in rows} == set(speed.STRATEGIES) and {r.tables for r in rows} == set(speed.TABLES)
    row = speed.Row(speed.PAPER_V, 16, 512, "cutbce_pallas", "bf16-adagrad")
    assert "global_batch_size=64" in row.overrides(chips=4) and "item_table_dtype=bfloat16" in row.overrides()
    assert f"synthetic_num_items={speed.PAPER_V - 1}" in row.overrides()


@pytest.mark.tier1
def test_rows_are_chosen_by_every_part_of_the_pattern():
    rows = speed.paper_rows()
    chosen = speed.select(rows, "V=876939,b=8 ,cutbce_pallas")
    assert chosen and all(r.vocab == speed.PAPER_V and r.batch == 8 and r.loss == "cutbce_pallas" for r in chosen)
    assert len(chosen) == 2 * 2          # N 256 and 512, two table modes
    assert speed.select(rows, None) == rows
    with pytest.raises(ValueError, match="matches no row"):
        speed.select(rows, "V=5")


@pytest.mark.tier1
def test_the_windows_come_from_the_trainers_log_lines_and_the_first_is_left_out():
    lines = ["config: ...", "step 25/100 | loss 0.5 | grad_norm 1 | lr 0.001 | 3.10 steps/s | 99 items/s | ETA 1m",
             "step 50/100 | loss 0.4 | grad_norm 1 | lr 0.001 | 30.00 steps/s | 990 items/s | ETA 1s",
             "eval ...", "step 75/100 | loss 0.4 | grad_norm 1 | lr 0.001 | 32.50 steps/s | 990 items/s | ETA 1s",
             "step 100/100 | loss 0.4 | grad_norm 1 | lr 0.001 | 31.00 steps/s | 990 items/s | ETA 0s"]
    rates = speed.window_rates(lines)
    assert rates == [3.1, 30.0, 32.5, 31.0]
    assert speed.median_after_first(rates) == 31.0
    assert speed.median_after_first(rates[:1]) is None


@pytest.mark.tier1
def test_parts_that_do_not_add_up_to_the_step_are_named():
    ok = dict(device_step_ms=10.0, loss_ms=5.0, model_ms=3.5, optimizer_ms=1.0)
    assert speed.check_parts(ok) is None
    short = dict(ok, model_ms=2.0)
    assert "0.80x" in speed.check_parts(short)
    assert speed.check_parts(dict(ok, loss_ms=6.6)) is not None


@pytest.mark.tier1
def test_the_record_merges_rows_by_key(tmp_path):
    path = tmp_path / "t3.json"
    speed.merge(path, dict(date="a"), [dict(key="x", v=1), dict(key="y", v=2)])
    data = speed.merge(path, dict(date="b"), [dict(key="y", v=3), dict(key="z", v=4)])
    assert [(r["key"], r["v"]) for r in data["rows"]] == [("x", 1), ("y", 3), ("z", 4)]
    assert json.loads(path.read_text())["info"] == dict(date="b")


@pytest.mark.tier1
def test_off_a_tpu_it_refuses(capsys):
    if jax.default_backend() == "tpu":
        pytest.skip("this host has a TPU")
    assert speed.main(["--json", "unused.json"]) == 2
    assert "measures a TPU" in capsys.readouterr().err
    # recloss-train's entry point hands `--table3` to it, and anything else to the trainer
    from recloss_plugins.sasrec import cli
    assert cli.main(["--table3", "--json", "unused.json"]) == 2
    assert "measures a TPU" in capsys.readouterr().err
    cli.main(["--help"])
    assert "usage: recloss-train [CONFIG.yml]" in capsys.readouterr().out


@pytest.mark.tier2
def test_a_tiny_row_end_to_end_on_cpu(tmp_path):
    """One small row through the whole measurement (trainer windows, compiled memory, timed parts)."""
    from recloss_plugins.config import default_config_path
    row = speed.Row(vocab=301, batch=4, seq=16, loss="cutbce", tables="bf16-adagrad")
    rec = speed.measure(row, str(default_config_path()), steps=20, window=5, rounds=2,
                        extra=["synthetic_num_users=64", "emb_dim=32", "num_heads=2", "mlp_dim=64", "num_layers=1",
                               "eval_batch_size=64"], log=print)
    assert len(rec["windows"]) == 4 and rec["steps_per_sec"] > 0
    assert rec["hbm_bytes"] > 0 and rec["device_step_ms"] > 0
    for part in ("loss_ms", "model_ms", "optimizer_ms"):
        assert 0 < rec[part] < 10 * rec["device_step_ms"], (part, rec)
    assert rec["parts_sum_ms"] == pytest.approx(rec["loss_ms"] + rec["model_ms"] + rec["optimizer_ms"], abs=1e-2)
    assert rec["compiles"] == 1, rec     # the step compiled once, for its memory, and reused by the run


@pytest.mark.tier1
def test_a_step_past_the_chips_memory_is_recorded_with_the_compilers_words(monkeypatch):
    from recloss_plugins.sasrec import program as program_lib

    class Refusing:
        def __init__(self, words):
            self.words = words

        def compiled_train_step(self, compiler_options=None):
            raise RuntimeError(self.words)

    cfg = types.SimpleNamespace(vocab_size=10)
    mesh = lambda cfg, devices: None
    monkeypatch.setattr("recloss_plugins.sasrec.parallel.build_mesh", mesh)
    monkeypatch.setattr(program_lib, "program_for", lambda *a, **k: Refusing(
        "RESOURCE_EXHAUSTED: XLA:TPU compile permanent error. Ran out of memory in memory space hbm. "
        "Used 19.36G of 15.75G hbm. Exceeded hbm capacity by 3.61G."))
    got, program = speed.memory(cfg, [jax.devices()[0]])
    assert program is None and set(got) == {"error"} and "19.36G of 15.75G" in got["error"]
    monkeypatch.setattr(program_lib, "program_for", lambda *a, **k: Refusing("some other compile failure"))
    with pytest.raises(RuntimeError, match="some other"):
        speed.memory(cfg, [jax.devices()[0]])


def _record(grid):
    """A complete record of ``grid`` in the form `speed.measure` writes (made-up figures: the renderer's
    input, not a measurement); the dense loss at the paper's vocabulary does not fit."""
    rows = []
    for i, r in enumerate(grid):
        rec = dict(key=r.key, overrides=r.overrides(), steps=200, window=25)
        if r.loss == "dense_bce" and r.vocab == speed.PAPER_V:
            rec["error"] = f"Used {19 + i}.36G of 15.75G hbm."
        else:
            rec.update(steps_per_sec=10.0 + i, hbm_bytes=(1 + i) * 2**30, xla_bytes=(2 + i) * 2**30,
                       device_step_ms=30.0 + i, loss_ms=10.0, model_ms=15.0, optimizer_ms=4.0,
                       parts_sum_ms=29.0, parts_calls=speed.CHAINED_CALLS)
            rec["parts_check"] = speed.check_parts(rec)
        rows.append(rec)
    return dict(info=dict(device="TPU v5 lite", jax="0.10.2", libtpu="0.0.42.1", date="2026-12-07", steps=200,
                          window=25, rounds=7), rows=rows)


@pytest.mark.tier1
def test_the_record_renders_every_row_in_the_grids_order_with_the_papers_figures():
    grid = speed.paper_rows()
    table = speed.format_table(_record(grid)).splitlines()
    body = [l for l in table if l.startswith("| ") and not l.startswith("| V ")]
    assert len(body) == len(grid)
    for i, (r, line) in enumerate(zip(grid, body)):
        cells = [c.strip() for c in line.strip("|").split("|")]
        assert cells[:5] == [f"{r.vocab:,}", str(r.batch), str(r.seq), f"`{r.loss}`", r.tables], (cells, r)
        assert cells[-1] == speed.paper_figure(r)
        if r.loss == "dense_bce" and r.vocab == speed.PAPER_V:
            assert cells[5] == "does not fit"
            assert f"Used {19 + i}.36G of 15.75G hbm." in "\n".join(table)
        else:
            assert cells[5] == f"{10.0 + i:.1f}" and cells[6] == f"{1 + i:.2f} / {2 + i:.2f}"
            ratio = 29.0 / (30.0 + i)      # the parts' sum over the step, marked past 10 %
            assert cells[11] == f"{ratio:.2f}×" + (" (off)" if ratio < 0.9 else ""), (cells, i)
    assert f"each a call's share of {speed.CHAINED_CALLS} chained calls" in table[0]
    paper = {(r.batch, r.seq, r.loss): speed.paper_figure(r) for r in grid
             if r.vocab == speed.PAPER_V and r.tables == "f32-adamw"}
    assert paper[(8, 256, "dense_bce")] == "6.14 steps/s, 22.37 GiB"
    assert paper[(8, 256, "cutbce_pallas")] == "20.01 steps/s, 7.67 GiB" and paper[(16, 512, "dense_bce")] == "out of memory"
    assert not any(speed.paper_figure(r) for r in grid if r.vocab != speed.PAPER_V or r.tables != "f32-adamw")


@pytest.mark.tier1
def test_a_missing_or_stale_row_keeps_the_record_from_rendering():
    grid = speed.paper_rows()
    good = _record(grid)
    missing = dict(good, rows=good["rows"][1:])
    with pytest.raises(ValueError, match=f"{grid[0].key}: not recorded"):
        speed.format_table(missing)
    stale = json.loads(json.dumps(good))
    stale["rows"][3]["overrides"] = stale["rows"][3]["overrides"][:-1]
    with pytest.raises(ValueError, match=f"{grid[3].key}: recorded with overrides .* \\(stale\\)"):
        speed.format_table(stale)
    gone = dict(good, rows=good["rows"] + [dict(good["rows"][5], key="V=5 b=1 N=2 cutbce f32-adamw")])
    with pytest.raises(ValueError, match="V=5 b=1 N=2 cutbce f32-adamw: recorded, but not a row"):
        speed.format_table(gone)
    empty = json.loads(json.dumps(good))
    del empty["rows"][6]["steps_per_sec"]
    assert speed.record_problems(empty) == [f"{grid[6].key}: recorded without steps/s or the compiler's error"]
    assert speed.record_problems(good) == []


@pytest.mark.tier1
def test_the_short_table_holds_the_papers_point_and_refuses_what_the_long_one_does():
    grid = speed.paper_rows()
    good = _record(grid)
    short = speed.format_short(good).splitlines()
    body = [l for l in short if l.startswith("| `")]
    want = [r for r in grid if r.vocab == speed.PAPER_V and r.batch == 8 and r.seq == 256]
    assert len(body) == len(want) == 8
    have = {r["key"]: r for r in good["rows"]}
    for r, line in zip(want, body):
        cells = [c.strip() for c in line.strip("|").split("|")]
        rec = have[r.key]
        assert cells[:2] == [f"`{r.loss}`", r.tables] and cells[-1] == speed.paper_figure(r)
        assert cells[2:4] == (["does not fit", "–"] if "error" in rec
                              else [f"{rec['steps_per_sec']:.1f}", f"{rec['xla_bytes'] / 2**30:.2f}"])
    with pytest.raises(ValueError, match="not recorded"):
        speed.format_short(dict(good, rows=good["rows"][:-1]))      # a row off its own point counts too
    # a record of a part of the grid renders against that part (docs/figures' TABLE3_ROWS)
    part = speed.select(grid, "b=8 ,N=256")
    speed.format_short(_record(part), part)
    old = json.loads(json.dumps(_record(part)))
    for r in old["rows"]:
        r.pop("parts_calls", None)
    assert "each call waited on alone" in speed.format_table(old, part).splitlines()[0]
