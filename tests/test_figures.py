"""The README's per-chip HBM figures: rendered from the committed records, and guarded on this stack.

docs/figures/hbm/jax-<jax>_libtpu-<libtpu>.json holds the rows `python -m tools.hbm_figures --topology ...
--record docs/figures/hbm` compiled on one (jax, libtpu) pair (`make figures` records both legs).
The README's marked tables must be what `python -m tools.figures` renders from them, and
the guard recompiles a few rows on the running stack and fails when temp or total HBM is more than
5 % above the stored figure (AOT memory analysis is deterministic for a given libtpu).
"""

import importlib.util
import json
import time

import pytest

from recloss.bench import cli
from tools import figures, hbm_figures

needs_libtpu = pytest.mark.skipif(importlib.util.find_spec("libtpu") is None,
                                  reason="libtpu is not importable (pip install 'jax[tpu]'): no TPU AOT compiler")
STACK = dict(python="3.11.0", jax="9.9.9", jaxlib="9.9.9", libtpu="0.0.1", tokamax=None)


def _row(strategy="cutbce_pallas", V=1000, temp=100, **kw):
    return dict(topology="v6e-8", strategy=strategy, B=2, N=8, D=128, V=V, L=8, dtype="float32",
                ideal_flops=6 * 2 * 8 * 128 * V, hbm_bytes=1000 + temp if isinstance(temp, int) else temp,
                temp_bytes=temp, argument_bytes=600, output_bytes=400, flops=1.0, compile_s=1.0, **kw)


# ----------------------------------------------------------------------------- no compile
@pytest.mark.tier1
def test_readme_tables_are_rendered_from_the_records():
    text = figures.README.read_text()
    names = [m["name"] for m in figures._BLOCK.finditer(text)]
    assert set(names) <= set(figures.TABLES) and len(names) == len(set(names)), names
    assert "v6e-headline" in names, "README.md's headline table is a rendered block"
    rendered = figures.render_readme(text)
    assert rendered == text, ("README.md's per-chip HBM tables differ from docs/figures/hbm: "
                              "run `python -m tools.figures` (and commit README.md)")


@pytest.mark.tier1
def test_record_merges_by_row_key(tmp_path):
    path, replaced, added = figures.record([_row(), _row(V=2000)], "bce", tmp_path, STACK)
    assert path == tmp_path / "jax-9.9.9_libtpu-0.0.1.json" and (replaced, added) == (0, 2)
    path, replaced, added = figures.record([_row(V=2000, temp=7), _row(V=3000)], "bce", tmp_path,
                                           dict(STACK, python="3.11.9"))
    assert (replaced, added) == (1, 1)
    data = figures.load(path)
    assert [(r["V"], r["temp_bytes"]) for r in data["rows"]] == [(1000, 100), (2000, 7), (3000, 100)]
    assert data["stack"]["python"] == "3.11.9" and data["rows"][0]["objective"] == "bce"
    assert json.loads(path.read_text()) == data     # one row per line, still plain JSON
    # Another objective (or options) is another row.
    figures.record([_row(strategy="cutbce_pallas")], "softmax", tmp_path, STACK)
    assert len(figures.load(path)["rows"]) == 4
    other = tmp_path / "other"
    other.mkdir()
    (other / path.name).write_text(path.read_text().replace('"jax": "9.9.9"', '"jax": "1.0"'))
    with pytest.raises(figures.RecordError, match="records jax 1.0 / libtpu 0.0.1, not this stack"):
        figures.record([_row()], "bce", other, STACK)


@pytest.mark.tier1
def test_a_half_recorded_table_does_not_render(tmp_path):
    from recloss.bench import topology

    rows = [dict(_row(), B=sh.B, N=sh.N, D=sh.D, V=sh.V) for sh in topology.PAPER_SHAPES]
    path, _, _ = figures.record(rows, "bce", tmp_path, STACK)
    text = figures.render_table("v6e-bce", path.stem, tmp_path)
    assert text.count("| cutbce_pallas |") == len(topology.PAPER_SHAPES) and "python 3.11.0, jax 9.9.9" in text
    figures.record([dict(rows[0], strategy="cutbce")], "bce", tmp_path, STACK)
    with pytest.raises(figures.RecordError, match=r"has cutbce at some bce shapes on v6e-8 but not at \(32, 128,"):
        figures.render_table("v6e-bce", path.stem, tmp_path)


@pytest.mark.tier1
def test_record_dir_errors_name_the_path(tmp_path):
    with pytest.raises(figures.RecordError, match=r"--record .*x\.json: expects a directory"):
        figures.check_record_dir(tmp_path / "x.json")
    (tmp_path / "file").write_text("")
    with pytest.raises(figures.RecordError, match=r"--record .*file: expects a directory"):
        figures.check_record_dir(tmp_path / "file")
    bad = figures.record_file(records_dir=tmp_path)
    bad.write_text("{not json")
    with pytest.raises(figures.RecordError, match=f"cannot read record file {bad}"):
        figures.check_record_dir(tmp_path)
    assert figures.check_record_dir(tmp_path / "new" / "dir") == figures.record_file(
        records_dir=tmp_path / "new" / "dir")


@pytest.mark.tier1
def test_a_stack_without_a_record_fails_with_the_recording_command(tmp_path, monkeypatch):
    monkeypatch.setattr(figures, "RECORDS_DIR", tmp_path)
    with pytest.raises(figures.RecordError) as err:
        figures.guarded_records()
    text = str(err.value)
    assert "no per-chip HBM record for this stack" in text and figures.stack_id(figures.current_stack()) in text
    assert "python -m tools.hbm_figures --topology v6e-8 --record docs/figures/hbm" in text
    assert "python -m tools.hbm_figures --topology v6e-8 --objective softmax --shapes table2 --record docs/figures/hbm" in text
    figures.record([_row()], "bce", tmp_path)       # a file without the guarded rows
    with pytest.raises(figures.RecordError, match="has no row for cutbce_pallas"):
        figures.guarded_records()


@pytest.mark.tier1
def test_compare_fails_above_the_tolerance_only():
    g = figures.GUARD_ROWS[0]
    stored = {g: _row(temp=1000)}
    assert not figures.compare({g: _row(temp=1040)}, stored)[1]          # +4 % temp
    lines, failures = figures.compare({g: _row(temp=1060)}, stored)      # +6 % temp, +3 % total
    assert len(failures) == 1 and "temp: stored" in failures[0] and "(1.060x)" in failures[0], lines
    lines, failures = figures.compare({g: _row(temp="OOM")}, stored)
    assert len(failures) == 2 and "now OOM" in failures[0]
    assert not figures.compare({g: _row(temp=10)}, stored)[1]            # better is fine


@pytest.mark.tier1
def test_render_check_mode(tmp_path, capsys):
    readme = tmp_path / "README.md"
    readme.write_text(figures.README.read_text())
    assert figures.main(["--check", "--readme", str(readme)]) == 0
    name = "v6e-headline"
    text = readme.read_text()
    head = text.index(f"<!-- figures:{name} ")
    row = text.index("| cutbce_pallas |", head)
    readme.write_text(text[:row] + "| cutbce_pallas | edited by hand |" + text[text.index("\n", row):])
    assert figures.main(["--check", "--readme", str(readme)]) == 1
    assert "differs from what its results files render" in capsys.readouterr().err
    assert figures.main(["--readme", str(readme)]) == 0 and readme.read_text() == text
    assert figures.main(["--check", "--readme", str(readme), "--records", str(tmp_path)]) == 2
    assert "no record file" in capsys.readouterr().err


# ----------------------------------------------------------------------------- the guard (compiles)
@pytest.fixture(scope="module")
def measured():
    try:
        figures.guarded_records()       # this stack's record first: no compiles when it is missing
    except figures.RecordError as err:
        pytest.fail(str(err), pytrace=False)
    t0 = time.perf_counter()
    rows = figures.compile_guarded()
    print(f"\n[guard] compiled {len(rows)} rows in {time.perf_counter() - t0:.1f}s")
    return rows


def _guard(measured):
    stored = figures.guarded_records()
    lines, failures = figures.compare(measured, stored)
    print(f"\n[guard] {figures.record_file()}\n" + "\n".join(lines))
    return failures


@pytest.mark.tier2
@pytest.mark.tpu_aot
@pytest.mark.xdist_group("figures_guard")     # one worker compiles the guarded rows once
@needs_libtpu
def test_guarded_figures_are_not_worse_than_recorded(measured):
    failures = _guard(measured)
    assert not failures, ("per-chip HBM grew more than 5 % over docs/figures/hbm on this stack:\n"
                          + "\n".join(failures) + "\nif intended, re-record (`make figures`) and commit")


@pytest.mark.tier1
@pytest.mark.parametrize("growth, fails", [(1.10, True), (1.04, False), (0.5, False)])
def test_guard_fails_on_growth_above_the_tolerance_against_a_record_it_builds(tmp_path, growth, fails):
    """The guard's whole path (a stack's record file written, its guarded rows read back, compared) on a
    record this test writes: figures 10 % above it fail every guarded row's temp and total, 4 % above or
    smaller pass, so an improvement of the committed figures never fails this test."""
    rows = {}
    for i, g in enumerate(figures.GUARD_ROWS, 1):
        temp = i * 2**20
        rows.setdefault(g.objective, []).append(dict(_row(g.strategy, V=g.V, temp=temp), B=g.B, N=g.N, D=g.D,
                                                     hbm_bytes=temp + 2**30))
    for objective, objective_rows in rows.items():
        figures.record(objective_rows, objective, tmp_path, STACK)
    stored = figures.guarded_records(STACK, tmp_path)
    assert set(stored) == set(figures.GUARD_ROWS)
    measured = {g: dict(r, temp_bytes=int(r["temp_bytes"] * growth), hbm_bytes=int(r["hbm_bytes"] * growth))
                for g, r in stored.items()}
    lines, failures = figures.compare(measured, stored)
    assert len(lines) == 2 * len(figures.GUARD_ROWS)
    if fails:
        assert len(failures) == 2 * len(figures.GUARD_ROWS) and all("(1.100x)" in f for f in failures), failures
    else:
        assert not failures, failures


@pytest.mark.tier1
def test_bad_record_paths_are_named_before_compiling(tmp_path, capsys):
    """--record DIR: a file or an uncreatable directory fail at once, naming the path; no --topology is
    a usage error."""
    cases = [
        (["--record", str(tmp_path)], "the following arguments are required: --topology"),
        (["--topology", "v6e-8", "--record", str(tmp_path / "hbm.json")],
         f"--record {tmp_path / 'hbm.json'}: expects a directory (the file name is chosen per stack: "),
        (["--topology", "v6e-8", "--record", "/proc/no/such/dir"],
         "--record /proc/no/such/dir: cannot create the directory"),
    ]
    for argv, message in cases:
        with pytest.raises(SystemExit):
            hbm_figures.main(argv)
        assert message in capsys.readouterr().err
    assert not list(tmp_path.iterdir())


@pytest.mark.tier1
@pytest.mark.tpu_aot
@needs_libtpu
def test_hbm_record_writes_this_stacks_file(tmp_path, capsys):
    argv = ["--topology", "v6e-8", "--strategies", "cutbce_pallas", "--shapes", "2,8,128,1000",
            "--record", str(tmp_path)]
    assert hbm_figures.main(argv) == 0
    assert hbm_figures.main(argv[:-3] + ["2,8,128,1000;2,8,128,3000", "--record", str(tmp_path)]) == 0
    data = figures.load(figures.record_file(records_dir=tmp_path))
    assert data["stack"] == figures.current_stack()
    rows = data["rows"]
    assert [(r["strategy"], r["V"]) for r in rows] == [("cutbce_pallas", 1000), ("cutbce_pallas", 3000)]
    for r in rows:
        assert r["hbm_bytes"] == r["argument_bytes"] + r["output_bytes"] + r["temp_bytes"]
        assert r["objective"] == "bce" and r["options"] == {}


@pytest.mark.tier1
def test_cpu_table_renders_its_results_file(tmp_path):
    """The CPU timing table is `rows.format_cpu` of the committed JSON; a missing file names its command."""
    table = figures.CPU_TABLES["cpu-bce"]
    data = json.loads((figures.FIGURES_DIR / table.file).read_text())
    (tmp_path / table.file).parent.mkdir(parents=True)
    data["rows"][0]["median_s"] = 98.765
    (tmp_path / table.file).write_text(json.dumps(data))
    text = figures.render_readme("<!-- figures:cpu-bce cpu -->\n<!-- /figures:cpu-bce -->", figures_dir=tmp_path)
    assert text.startswith("<!-- figures:cpu-bce cpu -->\n```sh\n" + table.command())
    assert "| 98.765 |" in text and text.endswith(f"jax {data['info']['jax_version']})\n<!-- /figures:cpu-bce -->")
    with pytest.raises(figures.RecordError, match=r"cannot read CPU results file .*cpu/bce\.json.*make bench"):
        figures.render_cpu_table("cpu-bce", tmp_path / "nowhere")
    with pytest.raises(figures.RecordError, match="figures:nope cpu names no CPU table"):
        figures.render_readme("<!-- figures:nope cpu -->\n<!-- /figures:nope -->")


def _pod_records(tmp_path, stacks):
    """Fake pod records under tmp_path/pod: stack i's row j needs (j + 1) + i/10 GiB."""
    pod = tmp_path / "pod"
    pod.mkdir()
    for i, stack in enumerate(stacks):
        rows = [dict(config=config, overrides=list(row.overrides), hbm_bytes=int((j + 1 + i / 10) * 2**30),
                     temp_bytes=2**29) for j, (config, row) in enumerate(figures.pod_rows().values())]
        figures.record_pod(rows, pod, stack=stack)
    return pod


@pytest.mark.tier1
def test_pod_tables_render_a_column_per_record(tmp_path):
    """Each pod table's cell is its row's record figure, one column per stack the marker names; the
    commands above it are the rows' recloss-train lines; a missing row names the recording command."""
    other = dict(STACK, python="3.12.1", jax="9.9.10", libtpu="0.0.2")
    pod = _pod_records(tmp_path, [STACK, other])
    stems = [figures.stack_id(STACK), figures.stack_id(other)]
    block = f"<!-- figures:pod-v5e pod={','.join(stems)} -->\n<!-- /figures:pod-v5e -->"
    text = figures.render_readme(f"intro\n{block}\nafter\n", figures_dir=tmp_path)
    table = figures.POD_TABLES["pod-v5e"]
    first = list(figures.pod_rows()).index(table.rows[0].name)
    assert f"| {' | '.join(table.rows[0].cells)} | {first + 1:.2f} GiB (temporaries 0.50) | " \
           f"{first + 1.1:.2f} GiB (temporaries 0.50) |" in text
    assert "per-chip HBM, jax 9.9.9, libtpu 0.0.1 (Python 3.11)" in text and "(Python 3.12)" in text
    for line in table.command_lines():
        assert line in text and line.startswith("recloss-train configs/sasrec_yambda.yml loss=cutbce_pallas")
    assert figures.render_readme(text, figures_dir=tmp_path) == text   # rendering is idempotent
    path = pod / f"{stems[1]}.json"
    data = json.loads(path.read_text())
    data["rows"] = [r for r in data["rows"] if r["overrides"] != list(table.rows[1].overrides)]
    path.write_text(json.dumps(data))
    with pytest.raises(figures.RecordError, match=rf"{stems[1]}\.json has no row '{table.rows[1].name}'.*pod_figures --record"):
        figures.render_pod_table("pod-v5e", stems, pod)
    with pytest.raises(figures.RecordError, match="figures:nope pod=... names no pod table"):
        figures.render_readme(f"<!-- figures:nope pod={stems[0]} -->\n<!-- /figures:nope -->", figures_dir=tmp_path)


@pytest.mark.tier1
def test_pod_record_merges_by_config_and_overrides(tmp_path):
    rows = [dict(config="c.yml", overrides=["a=1"], hbm_bytes=1, temp_bytes=0),
            dict(config="c.yml", overrides=["a=1", "b=2"], hbm_bytes=2, temp_bytes=0)]
    figures.record_pod(rows, tmp_path, stack=STACK)
    path, replaced, added = figures.record_pod([dict(rows[0], hbm_bytes=5)], tmp_path, stack=STACK)
    assert (replaced, added) == (1, 0)
    stack, by = figures.load_pod(path)
    assert stack["jax"] == "9.9.9" and {k: r["hbm_bytes"] for k, r in by.items()} == {
        ("c.yml", ("a=1",)): 5, ("c.yml", ("a=1", "b=2")): 2}
    with pytest.raises(figures.RecordError, match="not this stack"):
        figures._merge(path, dict(STACK, jax="1.0"), rows, lambda r: 0, ())


@pytest.mark.tier1
def test_pod_figures_refuses_bad_arguments_before_compiling(tmp_path, capsys):
    from tools import pod_figures
    with pytest.raises(SystemExit):
        pod_figures.main(["--record", str(tmp_path), "--only", "no such row"])
    assert "--only 'no such row' names no pod row (known: v6e-8 paper step, dense_bce;" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        pod_figures.main(["--record", str(tmp_path / "x.json")])
    assert "expects a directory" in capsys.readouterr().err


@pytest.mark.tier1
def test_the_docs_pod_blocks_name_the_test_legs_records():
    """docs/sharding.md renders each pod table once, from records that exist for both legs."""
    text = (figures.ROOT / "docs" / "sharding.md").read_text()
    found = {m["name"]: m["stacks"].split(",") for m in figures._POD_BLOCK.finditer(text)}
    assert set(found) == set(figures.POD_TABLES), found
    for stems in found.values():
        assert len(stems) == 2 and all((figures.POD_DIR / f"{s}.json").is_file() for s in stems), stems
    figures.render_readme(text)        # every row of every table is recorded


@pytest.mark.tier2
def test_a_cpu_run_writes_what_the_table_renders(tmp_path, capsys):
    """`recloss-bench --json` keeps what the printed table needs: the docs render the same text."""
    table = figures.CPU_TABLES["cpu-bce"]
    path = tmp_path / table.file
    path.parent.mkdir(parents=True)
    assert cli.main(["--quick", "--repeats", "1", "--json", str(path)]) == 0
    printed = capsys.readouterr().out
    rendered = figures.render_cpu_table("cpu-bce", tmp_path)
    body = rendered.split(":\n\n", 1)[1]
    assert json.loads(path.read_text())["info"]["total_s"] >= 0
    assert body.strip() and body.strip() in printed.strip(), (body, printed)


@pytest.mark.tier1
def test_cpu_runs_table_has_one_line_per_results_file(tmp_path):
    runs = figures.CPU_RUNS["cpu-bce-runs"]
    data = json.loads((figures.FIGURES_DIR / figures.CPU_TABLES["cpu-bce"].file).read_text())
    (tmp_path / "cpu").mkdir()
    for i, f in enumerate(runs.files):
        data["info"]["matmul_gflops_per_s"] = 100.0 + i
        (tmp_path / f).write_text(json.dumps(data))
    text = figures.render_cpu_runs("cpu-bce-runs", tmp_path)
    assert [line.split(" | ")[1] for line in text.splitlines() if line[:4] in {"| 1 ", "| 2 ", "| 3 ", "| 4 "}] == \
        ["100.0", "101.0", "102.0", "103.0"]
    assert "Over these runs:" in text
    data["rows"] = [r for r in data["rows"] if r["strategy"] != "dense_bce"]
    (tmp_path / runs.files[2]).write_text(json.dumps(data))
    with pytest.raises(figures.RecordError, match=r"bce-3\.json has no 'dense_bce' row"):
        figures.render_cpu_runs("cpu-bce-runs", tmp_path)
