"""The trainer's figures in the docs: tables whose runs need recloss_plugins, rendered from JSON.

A page commits the empty block ``<!-- figures:NAME run -->`` … ``<!-- /figures:NAME -->``; `render`
fills it from ``docs/figures/<file>`` with the same function that prints the table when the run's
command is run (`tools.figures` does the same for the library's benchmarks), so rerunning
the command shown above a table is how its figures change.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib
import json
import re
import sys
from pathlib import Path
from typing import Dict, Optional

from tools.figures import FIGURES_DIR, README, RecordError, write_rendered


@dataclasses.dataclass(frozen=True)
class RunTable:
    file: str           # under docs/figures
    command: str        # what writes it
    formatter: str      # "module:function" of the results dict -> Markdown (what the run prints)

    def render(self, figures_dir: Optional[Path] = None) -> str:
        path = Path(FIGURES_DIR if figures_dir is None else figures_dir) / self.file
        try:
            data = json.loads(path.read_text())
        except (OSError, ValueError) as err:
            raise RecordError(f"cannot read results file {path} ({err}): write it with `{self.command}`") from err
        module, _, name = self.formatter.partition(":")
        try:
            body = getattr(importlib.import_module(module), name)(data)
        except (KeyError, TypeError, ValueError) as err:
            raise RecordError(f"results file {path} lacks what its table needs ({type(err).__name__}: {err}): "
                              f"rerun `{self.command}`") from err
        rel = f"docs/figures/{self.file}"
        return "\n".join(["```sh", self.command, "```", "", f"Recorded in [`{rel}`]({rel}):", "", body])


# MaxText's vocab tiling against loss=cutce_pallas, on the Python 3.12 venv where MaxText installs.
MAXTEXT_TABLE = "\n".join(
    ".venv312/bin/python -m tools.maxtext_table --json docs/figures/data/maxtext.json --resume " + args
    for args in ("--topologies v6e-8",
                 "--models qwen3-0.6b --topologies v6e-8 --points 4x2048 --columns tiling8 --full-depth qwen3-0.6b",
                 "--models qwen3-0.6b gemma-2b llama3.1-8b --topologies v5p-8 --columns maxtext tiling4 tiling8 cutce",
                 "--models qwen3-0.6b gemma-2b llama3.1-8b --topologies v6e-8 v5p-8 --columns tiling4 tiling8 "
                 "--full-depth qwen3-0.6b --full-depth-columns tiling8",
                 "--models qwen3-0.6b gemma-2b llama3.1-8b --topologies v6e-8 v5p-8 --columns cutce_pallas-auto "
                 "cutce_pallas cutce_pallas-rows cutce_pallas-once --full-depth qwen3-0.6b",
                 "--topologies v6e-8 --columns tiling8 cutce_pallas-auto --largest"))

RUN_TABLES: Dict[str, RunTable] = {
    "input-bench": RunTable(
        "data/input-bench.json",
        "python -m tools.input_bench --events 20000000 --steps 30 --memory "
        "--json docs/figures/data/input-bench.json",
        "tools.input_bench:format_summary"),
    "prepare-ids": RunTable(
        "data/prepare-ids.json",
        "python -m tools.input_bench --mode prepare --events 20000000 "
        "--json docs/figures/data/prepare-ids.json",
        "tools.input_bench:format_prepare"),
    "sampled-bias": RunTable(
        "data/sampled-bias.json",
        "recloss-bench --sampled-bias --json docs/figures/data/sampled-bias.json --plot docs/sampled-bias.png",
        "recloss.bench.sampled_bias:format_table"),
    "sampled-bias-sasrec": RunTable(
        "data/sampled-bias-sasrec.json",
        "python -m tools.sampled_bias configs/base.yml loss=cutce steps=300 --draws 16 "
        "--json docs/figures/data/sampled-bias-sasrec.json",
        "recloss.bench.sampled_bias:format_table"),
    "quality": RunTable(
        "data/quality.json",
        "make quality QUALITY_ARGS='--sweep learning_rate=1e-3,3e-3,1e-2 --hbm --json docs/figures/data/quality.json'",
        "tools.quality:format_run"),
    "maxtext": RunTable("data/maxtext.json", MAXTEXT_TABLE, "tools.maxtext_table:format_table"),
    "mutants": RunTable("data/mutants.json", "make mutants", "tools.mutants:format_table"),
    "maxtext-headline": RunTable("data/maxtext.json", MAXTEXT_TABLE, "tools.maxtext_table:format_headline"),
}

_RUN_BLOCK = re.compile(r"(?P<start><!-- figures:(?P<name>[\w.-]+) run -->\n)(?P<body>.*?)"
                        r"(?P<end><!-- /figures:(?P=name) -->)", re.S)


def render(text: str, figures_dir: Optional[Path] = None) -> str:
    """``text`` with every ``<!-- figures:NAME run -->`` block filled from its results file."""
    def sub(m):
        name = m.group("name")
        if name not in RUN_TABLES:
            raise RecordError(f"block figures:{name} run names no run table (known: {', '.join(RUN_TABLES)})")
        return m.group("start") + RUN_TABLES[name].render(figures_dir) + "\n" + m.group("end")

    return _RUN_BLOCK.sub(sub, text)


def main(argv=None) -> int:
    """``python -m tools.run_figures [--check]``: README.md's run blocks, re-rendered."""
    parser = argparse.ArgumentParser(prog="python -m tools.run_figures", description=main.__doc__)
    parser.add_argument("--check", action="store_true",
                        help="do not write: exit 1 when README.md is not what the results files render")
    parser.add_argument("--readme", default=str(README), help="the README to render (default: %(default)s)")
    args = parser.parse_args(argv)
    readme = Path(args.readme)
    text = readme.read_text()
    try:
        new = render(text)
    except RecordError as err:
        print(f"figures: {err}", file=sys.stderr)
        return 2
    return write_rendered(readme, text, new, args.check, "python -m tools.run_figures")


if __name__ == "__main__":
    sys.exit(main())
