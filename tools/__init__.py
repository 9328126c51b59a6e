"""What records and renders this repository's figures and docs tables: not shipped in the wheel.

Run from the repository root (``python -m tools.figures``, ``make figures``); the tests and the docs
build import it from there. Every module here may read and write the source tree; the installed
packages (`recloss`, `recloss_plugins`) never do.
"""
