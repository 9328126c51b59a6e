"""The documentation site: `make docs`'s build is clean, its figures come from the records, and every
Python block of the README and the guides runs.

The build is Sphinx with warnings as errors (-W -n), as `make docs` runs it, into a temporary folder.
A Python block runs in one namespace per page, in page order, after the page's `PRELUDE` (the
arrays its prose assumes the reader already has); a page whose blocks a dedicated test runs with
stronger checks is named in `COVERED`.
"""

import contextlib
import io
import json
import os
import pathlib
import re
import shutil
import subprocess
import sys

import pytest

from helpers import python_blocks

ROOT = pathlib.Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"
PAGES = [ROOT / "README.md"] + sorted(DOCS.glob("*.md"))
COVERED = {"sharding.md": "tests/test_docs_examples.py::test_sharding_example_runs_and_equals_one_device"}
PRELUDE = {
    # The softmax head's snippet (a list item after the example) uses a reader's hidden states and rngs.
    "flax.md": """
import jax
from flax import nnx
rngs = nnx.Rngs(1)
hidden = jax.random.normal(jax.random.key(5), (16, 20, 32))
""",
    # The sampled example's prose: a model's hidden states, its table, a batch and the training counts.
    "choosing-a-loss.md": """
import jax, jax.numpy as jnp, recloss
V = 2_000
hidden = jax.random.normal(jax.random.key(0), (2, 16, 32))
table = jax.random.normal(jax.random.key(1), (V, 32)) * 0.05
targets = jax.random.randint(jax.random.key(2), (2, 16, 3), -1, V)
weights = (targets[..., 0] >= 0).astype(jnp.float32)
train_item_counts = jax.random.randint(jax.random.key(3), (V,), 0, 100)
step = 7
""",
}
@pytest.mark.tier1
def test_block_collector_reads_indented_blocks():
    text = "x\n```python\na = 1\n```\n* item\n\n  ```python\n  b = a + 1\n  ```\n```sh\nls\n```\n"
    assert python_blocks(text) == ["a = 1\n", "b = a + 1\n"]


@pytest.mark.tier2
@pytest.mark.parametrize("page", [p for p in PAGES if python_blocks(p.read_text(encoding="utf-8"))],
                         ids=lambda p: p.name)
def test_every_python_block_runs(page):
    blocks = python_blocks(page.read_text(encoding="utf-8"))
    if page.name in COVERED:
        # Not skipped: the covering test exists and runs these blocks.
        path, name = COVERED[page.name].split("::")
        assert f"def {name}(" in (ROOT / path).read_text(), COVERED[page.name]
        return
    ns = {"__name__": f"docs_{page.stem}"}
    with contextlib.redirect_stdout(io.StringIO()):
        if page.name in PRELUDE:
            exec(compile(PRELUDE[page.name], f"{page.name}:prelude", "exec"), ns)  # noqa: S102
        for i, block in enumerate(blocks):
            exec(compile(block, f"{page.name}:block {i + 1}", "exec"), ns)  # noqa: S102


def _build(out, env=None):
    cmd = [sys.executable, "-m", "sphinx", "-W", "-n", "--keep-going", "-q", "-b", "html", str(DOCS), str(out)]
    run = subprocess.run(cmd, capture_output=True, text=True, timeout=600,
                         env=dict(os.environ, JAX_PLATFORMS="cpu", **(env or {})))
    assert run.returncode == 0, f"`{' '.join(cmd)}` failed:\n{run.stdout[-4000:]}\n{run.stderr[-8000:]}"
    return out


@pytest.fixture(scope="module")
def site(tmp_path_factory):
    return _build(tmp_path_factory.mktemp("docs") / "html")


@pytest.mark.tier2
def test_the_site_builds_without_warnings_and_has_its_pages(site):
    index = (site / "index.html").read_text()
    for page in ("getting-started", "choosing-a-loss", "sharding", "kernels", "flax", "maxtext", "trainer",
                 "data", "benchmarks", "design", "development", "api"):
        assert (site / f"{page}.html").exists(), page
        assert f'href="{page}.html"' in index, f"index links no {page}.html"
    api = (site / "api.html").read_text()
    for name in ("recloss.bce_loss", "recloss.softmax_loss", "recloss.sampled_loss", "recloss.MeshLayout",
                 "recloss.psum_in_place", "recloss_plugins.flax.MultiLabelHead"):
        assert f'id="{name}"' in api, f"api.html documents no {name}"


def _paper_row(data):
    return next(r for r in data["rows"] if r["topology"] == "v6e-8" and r["objective"] == "bce"
                and r["strategy"] == "cutbce_pallas" and not r.get("options")
                and (r["B"], r["N"], r["D"], r["V"]) == (8, 256, 256, 876_939))


@pytest.mark.tier2
def test_a_record_changed_by_hand_changes_the_rendered_page(site, tmp_path):
    """The benchmark tables are rendered from docs/figures (hbm/, cpu/, pod/, data/) at build time, not
    typed into the page."""
    from tools import figures
    stack = "jax-0.10.2_libtpu-0.0.42.1"
    data = json.loads((figures.RECORDS_DIR / f"{stack}.json").read_text())
    gib = _paper_row(data)["hbm_bytes"] / 2**30
    assert f"| {gib:.3f} |" not in (DOCS / "benchmarks.md").read_text(), "a figure typed into the page"
    assert f"<td><p>{gib:.3f}</p></td>" in (site / "benchmarks.html").read_text()
    cpu = json.loads((figures.FIGURES_DIR / figures.CPU_TABLES["cpu-bce"].file).read_text())
    median = cpu["rows"][0]["median_s"]
    assert f"| {median:.3f} |" not in (DOCS / "benchmarks.md").read_text(), "a CPU timing typed into the page"
    assert f"<td><p>{median:.3f}</p></td>" in (site / "benchmarks.html").read_text()
    copy = tmp_path / "figures"
    shutil.copytree(figures.FIGURES_DIR, copy)
    _paper_row(data)["hbm_bytes"] = int(12.345 * 2**30)
    (copy / "hbm" / f"{stack}.json").write_text(figures.dumps(data))
    cpu["rows"][0]["median_s"] = 98.765
    (copy / figures.CPU_TABLES["cpu-bce"].file).write_text(json.dumps(cpu))
    pod = json.loads((figures.POD_DIR / f"{stack}.json").read_text())
    config, dp = figures.pod_rows()["v6e-8 paper step, data parallel"]
    pod_row = next(r for r in pod["rows"] if figures.pod_key(r["config"], r["overrides"]) ==
                   figures.pod_key(config, dp.overrides))
    pod_gib = pod_row["hbm_bytes"] / 2**30
    assert f"<td><p>{pod_gib:.2f} GiB" in (site / "sharding.html").read_text()
    pod_row["hbm_bytes"] = int(54.321 * 2**30)
    (copy / "pod" / f"{stack}.json").write_text(figures.dumps(pod))
    from tools import run_figures
    bench_file = copy / run_figures.RUN_TABLES["input-bench"].file
    bench = json.loads(bench_file.read_text())
    bench["read"][0]["sequences_per_s"] = 12345.6
    bench_file.write_text(json.dumps(bench))
    out = _build(tmp_path / "html", {"RECLOSS_FIGURES_DIR": str(copy)})
    html = (out / "benchmarks.html").read_text()
    assert "<td><p>12.345</p></td>" in html and f"<td><p>{gib:.3f}</p></td>" not in html
    assert "<td><p>98.765</p></td>" in html and f"<td><p>{median:.3f}</p></td>" not in html
    assert "<td><p>54.32 GiB (temporaries" in (out / "sharding.html").read_text()
    assert "12,346 and " in (out / "data.html").read_text()


# ----------------------------------------------------------------------------- shell blocks
_SH = re.compile(r"^(?P<indent>[ \t]*)```(?:sh|bash|shell)[ \t]*\n(?P<body>.*?)^(?P=indent)```[ \t]*$", re.M | re.S)


def shell_commands(text):
    """(words, expected error) for each command of the ```sh blocks: continuation lines joined,
    comments and env prefixes dropped. A command followed by '# <prog>: config error: ...' lines is
    a documented failure: the expected error is that text."""
    import shlex
    out = []
    for m in _SH.finditer(text):
        body = re.sub(r"\\\n\s*", " ", m.group("body"))
        for line in body.splitlines():
            line = line.strip()
            if line.startswith("#") and out and re.match(r"#\s*[\w-]+: config error: ", line) and out[-1][1] is None:
                out[-1] = (out[-1][0], line.split("config error: ", 1)[1])
                continue
            if not line or line.startswith("#"):
                continue
            words = shlex.split(line, comments=True)
            while words and re.fullmatch(r"[A-Z_][A-Z0-9_]*=\S*", words[0]):
                words = words[1:]                            # JAX_PLATFORMS=cpu ... prefixes
            if words:
                out.append((words, None))
    return out


def _check_command(words, makefile_targets):
    """None when the command's program, flags and config keys exist; else what is wrong.
    Returns 'unchecked' for a program this test does not know (pip, cd, ...)."""
    import importlib.util
    prog, args = os.path.basename(words[0]), words[1:]
    if prog == "recloss-train" and args[:1] == ["--table3"]:
        from recloss_plugins.config.pyconfig import load_config
        from recloss_plugins.sasrec.speed import PAPER_CONFIG, command_line
        try:
            parsed = command_line().parse_args(args[1:])
        except SystemExit:
            return f"recloss-train --table3 does not take {args[1:]}"
        with contextlib.chdir(ROOT):
            load_config([parsed.config or str(PAPER_CONFIG), *parsed.overrides])
        return None
    if prog in ("recloss-train", "recloss-prepare-data"):
        from recloss_plugins.config.pyconfig import load_config
        with contextlib.chdir(ROOT):
            load_config(args)                                 # unknown keys and bad values raise here
        return None
    if prog == "recloss-bench":
        from recloss.bench.cli import _parser
        try:
            _parser().parse_args(args)
        except SystemExit:
            return f"recloss-bench does not take {args}"
        return None
    if prog == "make":
        targets = [a for a in args if "=" not in a and not a.startswith("-")]
        missing = [t for t in targets if t not in makefile_targets]
        return f"the Makefile has no target {missing}" if missing else None
    if prog in ("python", "python3") and args[:1] == ["-m"]:
        return None if importlib.util.find_spec(args[1]) else f"no module {args[1]}"
    if prog == "recloss-maxtext-compile":
        return None if importlib.util.find_spec("recloss_plugins.maxtext.compile") else "no compile module"
    return "unchecked"


@pytest.mark.tier1
def test_the_options_table_has_every_loss_option_at_its_default():
    """docs/getting-started.md's options table against recloss.LossOptions: a field without a row, a row
    naming no field, or a default that is not the field's fails (a new option must be documented)."""
    import dataclasses

    import recloss

    text = (DOCS / "getting-started.md").read_text(encoding="utf-8")
    table = text.split("### Options (`recloss.LossOptions`)", 1)[1].split("\n\n", 2)[1]
    documented = {}
    for row in table.splitlines()[2:]:
        names, defaults = (re.findall(r"`([^`]*)`", cell) for cell in row.split("|")[1:3])
        assert len(names) == len(defaults) or len(defaults) == 1, row
        for name, default in zip(names, defaults * len(names) if len(defaults) == 1 else defaults):
            documented[name] = default
    fields = {f.name: f.default for f in dataclasses.fields(recloss.LossOptions)}
    assert set(documented) == set(fields), (f"missing rows: {sorted(set(fields) - set(documented))}; "
                                            f"rows naming no option: {sorted(set(documented) - set(fields))}")
    for name, default in fields.items():
        assert documented[name] == repr(default), (name, documented[name], repr(default))


@pytest.mark.tier1
def test_every_shell_command_names_programs_flags_and_keys_that_exist():
    """Commands that need a TPU, a bucket or a real data set are not run; their flags and config
    keys are checked against the parsers that would read them."""
    makefile_targets = set(re.findall(r"^([\w.-]+):", (ROOT / "Makefile").read_text(), re.M))
    checked, problems = 0, []
    from tools import figures
    from tools import run_figures
    for page in PAGES:
        # As rendered: the commands above each benchmark table are checked too.
        text = run_figures.render(figures.render_readme(page.read_text(encoding="utf-8")))
        for words, expected in shell_commands(text):
            try:
                problem = _check_command(words, makefile_targets)
                if expected:
                    problem = f"documented to fail with '{expected}', but passed"
            except Exception as err:  # noqa: BLE001 - the error is the finding
                problem = None if expected and str(err).startswith(expected) else f"{type(err).__name__}: {err}"
            if problem == "unchecked":
                continue
            checked += 1
            if problem:
                problems.append(f"{page.name}: `{' '.join(words)}`: {problem}")
    assert not problems, "\n".join(problems)
    assert checked >= 25, f"only {checked} documented commands checked"


# Why a documented command is checked for its flags and keys above but not run on tiny data below;
# a command that neither runs nor has a reason fails the test (a new example must be classified).
_MAKE_CI = {"test", "test-all", "test-py312", "docs"}
_MAKE_BENCH = {"bench", "bench-py312", "quality", "figures", "pod-figures", "mutants"}
NOT_RUN = (
    (lambda p, a: any(x.startswith("compile_topology=") for x in a),
     "an ahead-of-time TPU compile (minutes each; tests/test_pod_step.py compiles the pinned rows)"),
    (lambda p, a: any("/data/yambda" in x or "gs://" in x for x in a), "needs the real data set or a bucket"),
    (lambda p, a: p == "make" and set(a) <= _MAKE_CI, ".ci/run runs it"),
    (lambda p, a: p == "make" and a == ["train"],
     "the default job (minutes): tests/test_train.py trains its config on tiny data"),
    (lambda p, a: (p == "make" and a[:1] and a[0] in _MAKE_BENCH) or p in ("recloss-bench", "for")
     or (p in ("python", "python3") and (a[:1] == ["-c"] or (a[:1] == ["-m"] and a[1].startswith("tools.")
                                                                 and a[1] != "tools.maxtext_table"))),
     "a benchmark or figure recording (minutes): its output is the results file the page renders"),
    (lambda p, a: p == "recloss-maxtext-compile" or a[1:2] in (["recloss_plugins.maxtext.train"],
                                                                ["tools.maxtext_table"]),
     "needs MaxText and a TPU compile (tests/test_maxtext_*.py)"),
    (lambda p, a: p == "recloss-train" and a[:1] == ["--table3"],
     "a measurement on a TPU (it refuses any other backend; tests/test_table3.py runs a tiny row on CPU)"),
    (lambda p, a: p == "pip", "installs packages"),
    (lambda p, a: p in ("python", "python3") and a[:2] == ["-m", "pytest"],
     "the suite on a TPU VM (make test runs it here, kernels interpreted)"),
)
# Appended to a documented recloss-train / recloss-prepare-data command: the same command at toy size.
TINY = ["synthetic_num_users=48", "synthetic_num_items=255", "synthetic_min_len=20", "synthetic_max_len=30",
        "num_labels=4", "max_seq_len=8", "global_batch_size=16", "emb_dim=16", "num_layers=1", "num_heads=2",
        "mlp_dim=32", "steps=2", "log_period=1", "eval_batch_size=64", "eval_block_v=128",
        "enable_tensorboard=false"]


def _tiny_log(path):
    """A Parquet log the documented interaction commands read: 300 users x 35 time-ordered events over
    200 items, the user id under both `uid` (configs/base.yml) and `user_id` (trainer.md)."""
    import numpy as np
    import pyarrow as pa
    import pyarrow.parquet as pq
    rng = np.random.default_rng(0)
    users = np.repeat(np.arange(300) * 7 + 11, 35)
    pq.write_table(pa.table({"uid": users, "user_id": users, "item_id": rng.integers(1, 201, users.size),
                             "timestamp": np.arange(users.size)}), path)


def _not_run_reason(words):
    prog, args = os.path.basename(words[0]), words[1:]
    return next((why for match, why in NOT_RUN if match(prog, args)), None)


@pytest.mark.tier2
def test_documented_trainer_commands_run_on_tiny_data(tmp_path, capsys):
    """Each `recloss-train` / `recloss-prepare-data` command of the pages that can run on a CPU runs, in
    page order (a prepare before the train that reads it), with TINY appended and /data/ paths moved
    under tmp_path; every other command has a reason in NOT_RUN."""
    from tools import figures
    from tools import run_figures
    from recloss_plugins.sasrec.data.prepare import main as prepare_main
    from recloss_plugins.sasrec.train import main as train_main
    ran, unclassified = [], []
    for page in PAGES:
        work = tmp_path / page.stem
        work.mkdir()
        (work / "configs").symlink_to(ROOT / "configs")
        _tiny_log(work / "log.parquet")
        text = run_figures.render(figures.render_readme(page.read_text(encoding="utf-8")))
        for words, expected in shell_commands(text):
            prog = os.path.basename(words[0])
            if expected or _not_run_reason(words):
                continue
            if prog not in ("recloss-train", "recloss-prepare-data"):
                unclassified.append(f"{page.name}: `{' '.join(words)}`")
                continue
            args = [a.replace("=/data/", f"={work}/data/") for a in words[1:]]
            args += TINY + [f"base_output_directory={work / 'runs'}"]
            with contextlib.chdir(work):
                rc = (train_main if prog == "recloss-train" else prepare_main)(args)
            out = capsys.readouterr()
            assert rc == 0, f"{page.name}: `{' '.join(words)}` (+ tiny overrides) exited {rc}:\n{out.err[-3000:]}"
            ran.append(f"{page.name}: {' '.join(words)}")
    assert not unclassified, "commands neither run here nor given a reason in NOT_RUN:\n" + "\n".join(unclassified)
    print("\n".join(ran))
    assert len(ran) >= 6, ran


# ----------------------------------------------------------------------------- a real browser
CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
# .ci/run installs Debian's chromium and sets this: there the browser test must run, not skip.
REQUIRE_BROWSER = os.environ.get("RECLOSS_REQUIRE_BROWSER") == "1"


def _browse(url, profile):
    """(DOM after the page's scripts ran, the console messages) of headless Chromium at ``url``."""
    cmd = [CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
           "--disable-background-networking", "--disable-component-update", "--disable-sync",
           f"--user-data-dir={profile}", "--enable-logging=stderr", "--v=0", "--virtual-time-budget=5000",
           "--dump-dom", url]
    run = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, f"chromium failed on {url}:\n{run.stderr[-4000:]}"
    console = [line for line in run.stderr.splitlines() if ":CONSOLE" in line]
    return run.stdout, console


@pytest.mark.tier2
def test_the_site_renders_in_a_real_browser(site, tmp_path):
    """Headless Chromium loads the index, the API page and a search over localhost: the headings
    render, the search finds the API page, and no page writes to the console (errors, 404s)."""
    if CHROMIUM is None:
        assert not REQUIRE_BROWSER, "RECLOSS_REQUIRE_BROWSER=1 but no chromium on PATH (apt-get install chromium)"
        pytest.skip("no chromium on PATH (Debian: apt-get install chromium); .ci/run installs it")
    import functools
    import http.server
    import threading
    handler = functools.partial(http.server.SimpleHTTPRequestHandler, directory=str(site))
    handler.log_message = lambda *a, **k: None
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    base = f"http://127.0.0.1:{server.server_address[1]}"
    try:
        index, c1 = _browse(f"{base}/index.html", tmp_path / "p1")
        api, c2 = _browse(f"{base}/api.html", tmp_path / "p2")
        search, c3 = _browse(f"{base}/search.html?q=psum_in_place", tmp_path / "p3")
    finally:
        server.shutdown()
    assert re.search(r"<h1>recloss<a ", index), index[:2000]
    assert re.search(r"<h1>API reference<a ", api) and 'id="recloss.bce_loss"' in api
    found = re.search(r"Search finished, found (\d+) page", search)
    assert found and int(found.group(1)) >= 1, search[-3000:]
    assert 'href="api.html' in search, "the search for psum_in_place does not list the API page"
    assert not (c1 + c2 + c3), "console messages:\n" + "\n".join(c1 + c2 + c3)
