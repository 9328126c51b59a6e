"""Strategies by name: the table `recloss.get_strategy` looks names up in.

It holds factories only and imports no implementation: `recloss.api` fills it
from its explicit table of built-in strategies, and `register_strategy` adds a
user's own.
"""

from __future__ import annotations

import difflib
from typing import Callable, Dict, Optional

from recloss.options import LossOptions

_REGISTRY: Dict[str, Callable] = {}


def register_strategy(name: str, factory: Callable):
    """Registers ``factory(options) -> Strategy`` under ``name`` (replacing any previous one)."""
    if not isinstance(name, str) or not name:
        raise ValueError(f"strategy name must be a non-empty str, got {name!r}")
    if not callable(factory):
        raise TypeError(f"factory for strategy {name!r} must be callable, got {factory!r}")
    _REGISTRY[name] = factory


def available_strategies(objective: Optional[str] = None) -> tuple:
    """Names of the registered strategies, sorted; only those of ``objective`` ('bce', 'softmax', 'sampled')
    when given."""
    names = tuple(sorted(_REGISTRY))
    if objective is None:
        return names
    return tuple(n for n in names if get_strategy(n).objective == objective)


def strategies_on(platform: str) -> list:
    """Names of the registered strategies that run on ``platform`` ('cpu', 'gpu', 'tpu'), sorted."""
    return [n for n in available_strategies() if get_strategy(n).supported_on(platform)]


def get_strategy(name: str, options: Optional[LossOptions] = None, **kwargs):
    """The strategy ``name`` with ``options`` (a LossOptions) and/or option keywords."""
    if name not in _REGISTRY:
        close = difflib.get_close_matches(str(name), list(_REGISTRY), n=1)
        hint = f"; did you mean {close[0]!r}?" if close else ""
        raise ValueError(f"unknown strategy {name!r}: available are {available_strategies()}{hint}")
    unknown = [k for k in kwargs if k not in LossOptions.field_names()]
    if unknown:
        hints = [f"{k!r}" + (f" (did you mean {c[0]!r}?)" if (c := difflib.get_close_matches(
            k, LossOptions.field_names(), n=1)) else "") for k in unknown]
        raise TypeError(f"unknown loss option(s) {', '.join(hints)}; valid options: "
                        f"{LossOptions.field_names()}")
    if options is not None and not isinstance(options, LossOptions):
        raise TypeError(f"options must be a recloss.LossOptions, got {type(options).__name__}")
    options = (options or LossOptions()).replace(**kwargs) if kwargs else (options or LossOptions())
    return _REGISTRY[name](options)
