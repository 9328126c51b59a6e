"""``recloss-train``: trains the reference model (`recloss_plugins.sasrec.train.main`), or, given
``--table3`` first, measures the paper's Table III on this chip (`recloss_plugins.sasrec.speed.main`,
which drives the trainer: the two are kept apart so that neither imports the other's entry point)."""

from __future__ import annotations

import sys


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == ["--table3"]:
        from recloss_plugins.sasrec import speed
        return speed.main(argv[1:])
    from recloss_plugins.sasrec import train
    return train.main(argv)


if __name__ == "__main__":
    sys.exit(main())
