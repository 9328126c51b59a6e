"""The trainer's tables in the docs (`tools.run_figures`): rendered from their JSON.

The input benchmark's table is `input_bench.format_summary` of docs/figures/data/input-bench.json, the
function the benchmark prints it with; a changed figure changes the rendered text, a missing file or
field names the command that writes it, and the rate the summary reads is the one the trainer logs.
"""

import json
import os

import pytest

from recloss_plugins.config import default_config_path, load_config
from recloss_plugins.sasrec.train import train
from tools import input_bench, run_figures as figures
from tools.figures import RecordError

TABLE = figures.RUN_TABLES["input-bench"]


def _summary():
    return json.loads((figures.FIGURES_DIR / TABLE.file).read_text())


@pytest.mark.tier1
def test_input_bench_table_renders_its_results_file(tmp_path):
    data = _summary()
    data["read"][0]["sequences_per_s"] = 12345.6
    (tmp_path / TABLE.file).parent.mkdir(parents=True)
    (tmp_path / TABLE.file).write_text(json.dumps(data))
    text = figures.render("a\n<!-- figures:input-bench run -->\n<!-- /figures:input-bench -->\nb", tmp_path)
    assert text.startswith("a\n<!-- figures:input-bench run -->\n```sh\n" + TABLE.command + "\n```")
    assert "| 12,346 and " in text and text.endswith("<!-- /figures:input-bench -->\nb")
    assert input_bench.format_summary(data) in text
    assert figures.render(text, tmp_path) == text
    with pytest.raises(RecordError, match=r"cannot read results file .*input-bench\.json.*input_bench --events"):
        TABLE.render(tmp_path / "nowhere")
    del data["train"]
    (tmp_path / TABLE.file).write_text(json.dumps(data))
    with pytest.raises(RecordError, match=r"lacks what its table needs \(KeyError: 'train'\): rerun"):
        TABLE.render(tmp_path)
    with pytest.raises(RecordError, match="figures:nope run names no run table"):
        figures.render("<!-- figures:nope run -->\n<!-- /figures:nope -->")


@pytest.mark.tier1
def test_input_bench_summary_says_how_far_input_outpaces_training():
    data = _summary()
    text = input_bench.format_summary(data)
    slowest = min(r["sequences_per_s"] for r in data["read"])
    fed = max(x for r in data["train"] for x in r["steps_per_s"]) * data["train_batch"] / 2
    assert f"~{slowest / fed:,.0f} per process" in text
    assert ("data_pipeline=memory" in text) == bool(data.get("train_memory"))


@pytest.mark.tier2
def test_the_rate_the_bench_reads_is_the_one_the_trainer_logs(tmp_path):
    tiny = ["synthetic_num_users=48", "synthetic_num_items=255", "synthetic_min_len=20", "synthetic_max_len=30",
            "num_labels=4", "max_seq_len=8", "global_batch_size=16", "emb_dim=16", "num_layers=1", "num_heads=2",
            "mlp_dim=32", "log_period=2", "steps=6", "enable_checkpointing=false", "enable_tensorboard=false",
            f"base_output_directory={tmp_path}"]
    lines = []
    train(load_config([str(default_config_path()), *tiny]), stop_after=6,
          log=lambda *a: lines.append(" ".join(map(str, a))))
    rates = [float(m.group(1)) for line in lines for m in [input_bench.RATE.search(line)] if m]
    assert len(rates) == 3 and all(r > 0 for r in rates), lines


@pytest.mark.tier1
def test_the_docs_run_blocks_are_known_tables():
    """Every run table is on a page (a guide or the README), and every page's run block names one."""
    root = os.path.join(os.path.dirname(__file__), os.pardir, "docs")
    pages = [os.path.join(root, name) for name in os.listdir(root) if name.endswith(".md")] + [str(figures.README)]
    found = set()
    for page in pages:
        text = open(page).read()
        found |= {m["name"] for m in figures._RUN_BLOCK.finditer(text)}
        figures.render(text)
    assert found == set(figures.RUN_TABLES), found


@pytest.mark.tier2
def test_quality_table_is_what_the_run_printed(tmp_path, monkeypatch, capsys):
    """`quality --json` keeps what the table needs: the docs render the table the run printed."""
    from tools import quality
    monkeypatch.setattr(quality, "ROWS", [r for r in quality.ROWS if r[0] in ("cutbce", "gbce K=128")])
    path = tmp_path / "quality.json"
    tiny = ["synthetic_num_users=48", "synthetic_num_items=255", "synthetic_min_len=20", "synthetic_max_len=30",
            "num_labels=4", "max_seq_len=8", "global_batch_size=16", "emb_dim=16", "num_layers=1",
            "num_heads=2", "mlp_dim=32", "steps=4", "eval_batch_size=32", f"base_output_directory={tmp_path}"]
    assert quality.main([*tiny, "--json", str(path)]) == 0
    printed = capsys.readouterr().out
    data = json.loads(path.read_text())
    assert [r["loss"] for r in data["rows"]] == ["cutbce", "gbce K=128"]
    table = quality.markdown(data["rows"], data["info"]["eval_top_k"])
    assert table in printed and "v6e-8" not in table          # no --hbm: no column of "not run"
    text = quality.format_run(data)
    assert text.startswith(table) and "2 runs of 4 steps" in text
    assert data["info"]["config"][0] == "configs/base.yml"


@pytest.mark.tier1
def test_readme_run_blocks_are_what_their_results_files_render():
    text = figures.README.read_text()
    assert "<!-- figures:prepare-ids run -->" in text
    assert figures.render(text) == text, ("README.md's run tables differ from docs/figures/data: run "
                                          "`python -m tools.run_figures` (and commit README.md)")
    assert figures.main(["--check"]) == 0


@pytest.mark.tier1
def test_prepare_table_gives_both_rates_and_every_pair(tmp_path):
    summary = "prepared /x: 7 users, 5 items, 40 interactions (of 50 events read), 2 shards, 0.1 MiB, {}s"
    runs = lambda secs: [{"seconds": x, "wall_s": x + 2, "peak_rss_mib": 100 + x, "summary": summary.format(x)}
                         for x in secs]
    out = {"events": 3_000_000, "repeats": 3, "log_mib": {"int": 20.4, "string": 26.6},
           "runs": {"int": runs([2.0, 2.5, 3.0]), "string": runs([2.4, 2.5, 3.9])}}
    text = input_bench.format_prepare(out)
    assert "| integers | 20 MiB Parquet | 2.5 s | 1.20 M | 103 MiB |" in text
    assert "| strings (`user-<id>`) | 27 MiB Parquet | 2.5 s | 1.20 M | 104 MiB |" in text
    assert "String ids take 1.00x the integer-id time (interleaved pairs: 1.20x, 1.00x, 1.30x)" in text
    assert "both preparations kept the same 7 users, 5 items, 40 interactions (of 50 events read)." in text
    out["runs"]["string"][1]["summary"] = summary.format(1).replace("7 users", "6 users")
    assert "DIFFER: 6 users, 5 items, 40 interactions (of 50 events read); 7 users" in input_bench.format_prepare(out)


@pytest.mark.tier2
def test_quality_sweep_reports_each_rows_run_best_on_dev(tmp_path, monkeypatch, capsys):
    """`quality --sweep KEY=V1,V2`: each row trains once per value its loss takes and reports the run
    with the best dev NDCG; a key the loss does not take (temperature for a BCE loss) is left out."""
    from tools import quality
    monkeypatch.setattr(quality, "ROWS", [r for r in quality.ROWS if r[0] in ("cutbce", "gbce K=128")])
    path = tmp_path / "quality.json"
    tiny = ["synthetic_num_users=48", "synthetic_num_items=255", "synthetic_min_len=20", "synthetic_max_len=30",
            "num_labels=4", "max_seq_len=8", "global_batch_size=16", "emb_dim=16", "num_layers=1",
            "num_heads=2", "mlp_dim=32", "steps=4", "eval_batch_size=32", f"base_output_directory={tmp_path}"]
    assert quality.main([*tiny, "--sweep", "learning_rate=1e-3,3e-2", "--sweep", "temperature=0.5,1.0",
                         "--json", str(path)]) == 0
    data = json.loads(path.read_text())
    bce, gbce = data["rows"]
    assert [t["overrides"] for t in bce["sweep"]] == [["learning_rate=1e-3"], ["learning_rate=3e-2"]]
    assert len(gbce["sweep"]) == 4 and ["learning_rate=3e-2", "temperature=0.5"] in [t["overrides"] for t in gbce["sweep"]]
    for row in data["rows"]:
        best = max(row["sweep"], key=lambda t: t["dev_ndcg"])
        assert row["chosen"] == best["overrides"] and row["dev_ndcg"] == best["dev_ndcg"]
    text = quality.format_run(data)
    assert "best on dev |" in text and "6 runs of 4 steps" in text and "--sweep learning_rate=1e-3,3e-2" in text
    assert quality.markdown(data["rows"], data["info"]["eval_top_k"]) in capsys.readouterr().out
    for bad, msg in (("learning_rate", "expected KEY=V1,V2"), ("learnin_rate=1", "is not a config key")):
        with pytest.raises(SystemExit):
            quality.main([*tiny, "--sweep", bad])
        assert msg in capsys.readouterr().err
