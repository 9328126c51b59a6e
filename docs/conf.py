"""Sphinx configuration of the recloss docs: MyST Markdown guides and an API reference from the docstrings.

`make docs` builds it offline into docs/_build/html with warnings as errors (`-W -n`): a broken
internal link, a missing cross-reference or an unrendered figure fails the build. Benchmark tables
are not typed into the pages: each ``<!-- figures:NAME stack=STACK -->`` block is filled at build
time from the committed record file it names (docs/figures/, `tools.figures`).
"""

import sys
from pathlib import Path

DOCS = Path(__file__).resolve().parent
sys.path.insert(0, str(DOCS / "_ext"))
sys.path.insert(0, str(DOCS.parent))

project = "recloss"
author = "the recloss authors"
copyright = "2026, the recloss authors"

extensions = [
    "myst_parser",
    "sphinx.ext.autodoc",
    "sphinx.ext.autosummary",
    "sphinx.ext.napoleon",
    "recloss_figures",
]
source_suffix = {".md": "markdown"}
root_doc = "index"
exclude_patterns = ["_build", "figures/hbm/README.md"]
myst_enable_extensions = ["colon_fence"]
myst_heading_anchors = 3
html_theme = "furo"
html_title = "recloss"
html_static_path = []

# The docstrings are plain text (shapes, formulas with |T| and `code`), not reStructuredText:
# backticks render as code, and a '|' is a character, not a substitution.
default_role = "literal"


def _plain_pipes(app, what, name, obj, options, lines):
    lines[:] = [line.replace("|", "\\|") for line in lines]


def setup(app):
    app.connect("autodoc-process-docstring", _plain_pipes)


autosummary_generate = False   # api.md documents each name with autodoc; autosummary only lists them
autodoc_default_options = {}   # members are listed per class in api.md
autodoc_typehints = "signature"
autodoc_member_order = "bysource"
# Docstrings name jax/numpy types that have no inventory here (the build is offline): resolving them
# is not a check of the project's own links, which `-n` still enforces.
nitpick_ignore_regex = [("py:.*", r"(jax|jnp|np|numpy|optax|flax|nnx|jaxtyping|typing|collections)\b.*"),
                        ("py:.*", r"(Array|ArrayLike|PRNGKey|Mesh|PartitionSpec|Optional|Callable|Sequence|Mapping|Any)\b.*")]
# Args/Returns sections are read as Google style; their types are prose ("[..., D] float32"), not
# references to resolve.
napoleon_use_param = False
napoleon_use_rtype = False
napoleon_preprocess_types = False
