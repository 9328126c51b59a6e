"""recloss's version: pyproject.toml's, read back from the installed package's metadata."""

from importlib import metadata


def version() -> str:
    try:
        return metadata.version("recloss")
    except metadata.PackageNotFoundError:   # imported from a source tree that was never pip-installed
        return "0+unknown"
