"""Fills each page's ``<!-- figures:NAME ... -->`` blocks from the results files at build time.

A page commits only the empty block; `tools.figures.render_readme` renders the table from
``docs/figures/hbm/STACK.json`` (``stack=STACK``: per-chip HBM), the CPU table's JSON under
``docs/figures/cpu`` (``cpu``) or the pod-step records under ``docs/figures/pod`` (``pod=STACK,...``),
and `tools.run_figures.render` the trainer's runs (``run``), when Sphinx reads the
page, so changing a results file changes the page.
"""

import os
from pathlib import Path

from tools import figures
from tools import run_figures

# RECLOSS_FIGURES_DIR: render from another figures folder (hbm/, cpu/, pod/, data/; the docs test edits a copy).
ENV = "RECLOSS_FIGURES_DIR"


def _fill(app, docname, source):
    text = source[0]
    if "<!-- figures:" not in text:
        return
    where = Path(os.environ[ENV]) if os.environ.get(ENV) else None
    text = run_figures.render(figures.render_readme(text, figures_dir=where), where)
    # Rendered for README.md at the repository root: its links into docs/ are relative to docs/ here.
    source[0] = text.replace("](docs/", "](")


def setup(app):
    app.connect("source-read", _fill)
    return {"parallel_read_safe": True, "parallel_write_safe": True}
