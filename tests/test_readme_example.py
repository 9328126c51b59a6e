"""The "Add recloss to your Flax trainer" example runs as printed and trains.

The section is read from README.md when it has it, else from docs/flax.md
(where the text lives until it is pasted into the README).
"""

import contextlib
import io
import pathlib
import re

ROOT = pathlib.Path(__file__).resolve().parents[1]
HEADING = "## Add recloss to your Flax trainer"


def extract_section(text: str):
    """Text after the heading up to the next '## ' heading, or None without the heading."""
    m = re.search(r"^" + re.escape(HEADING) + r"[ \t]*$", text, flags=re.MULTILINE)
    if m is None:
        return None
    rest = text[m.end():]
    nxt = re.search(r"^## ", rest, flags=re.MULTILINE)
    return rest[:nxt.start()] if nxt else rest


def _section_source():
    """(path, section) from README.md if it has the heading, else from docs/flax.md."""
    for path in (ROOT / "README.md", ROOT / "docs" / "flax.md"):
        if path.exists():
            section = extract_section(path.read_text(encoding="utf-8"))
            if section is not None:
                return path, section
    raise AssertionError(f"neither README.md nor docs/flax.md has the heading {HEADING!r}")


def python_blocks(section: str):
    """The ```python fenced blocks of ``section``, in order."""
    return [m.group(1) for m in re.finditer(r"^```python[ \t]*\n(.*?)^```[ \t]*$", section,
                                            flags=re.MULTILINE | re.DOTALL)]


def test_extraction_finds_first_python_block():
    doc = ("# T\n\n## Other\n```python\nx = 0\n```\n" + HEADING + "\n\ntext\n```bash\nls\n```\n"
           "```python\na = 1\n```\n```python\nb = 2\n```\n## Next\n```python\nc = 3\n```\n")
    assert python_blocks(extract_section(doc)) == ["a = 1\n", "b = 2\n"]
    assert extract_section("# T\n## Add recloss to your Flax trainers\n") is None


def test_flax_example_runs_and_learns():
    path, section = _section_source()
    blocks = python_blocks(section)
    assert blocks, f"no ```python block after {HEADING!r} in {path}"
    namespace = {"__name__": "readme_example"}
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        exec(compile(blocks[0], f"{path.name}:{HEADING}", "exec"), namespace)  # noqa: S102
    losses = namespace["losses"]
    assert len(losses) >= 2 and all(v == v for v in losses), losses  # no NaN
    assert losses[-1] < 0.1 * losses[0], f"example loss did not fall: {losses[0]} -> {losses[-1]}"
    metrics = namespace["metrics"]
    recall = float(metrics["tp"] / (metrics["tp"] + metrics["fn"]))
    assert recall > 0.5, f"example model did not learn its targets: recall {recall}"
    assert "loss" in out.getvalue()

