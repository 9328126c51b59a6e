"""Strategies by name: the table `recloss.get_strategy` looks names up in.

It holds factories only and imports no implementation: `recloss.api` fills it
from its explicit table of built-in strategies, and `register_strategy` adds a
user's own.
"""

from __future__ import annotations

import difflib
import inspect
from typing import Callable, Dict, Optional

from recloss.options import LossOptions

_REGISTRY: Dict[str, Callable] = {}

# Keywords that configure a strategy object rather than the loss (`recloss.pallas.strategy.PallasStrategy`:
# the chip to tile for, the interpreter's parameters). They are not LossOptions fields.
STRATEGY_ARGS = ("chip", "interpret_params")


def register_strategy(name: str, factory: Callable):
    """Registers ``factory(options) -> Strategy`` under ``name`` (replacing any previous one)."""
    if not isinstance(name, str) or not name:
        raise ValueError(f"strategy name must be a non-empty str, got {name!r}")
    if not callable(factory):
        raise TypeError(f"factory for strategy {name!r} must be callable, got {factory!r}")
    _REGISTRY[name] = factory


def unregister_strategy(name: str):
    """Removes the strategy ``name`` (a KeyError naming the registered ones when there is none)."""
    if name not in _REGISTRY:
        raise KeyError(f"no strategy {name!r} is registered; registered are {available_strategies()}")
    del _REGISTRY[name]


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


def _takes(factory, arg: str) -> bool:
    try:
        params = inspect.signature(factory).parameters
    except (TypeError, ValueError):
        return False
    return arg in params or any(p.kind is p.VAR_KEYWORD for p in params.values())


def get_strategy(name: str, options: Optional[LossOptions] = None, **kwargs):
    """The strategy ``name`` with ``options`` (a LossOptions) and/or option keywords.

    ``chip=`` ('v4', 'v5e', 'v5p', 'v6e', 'v7': tile for that chip) and ``interpret_params=`` (a
    ``pltpu.InterpretParams``) configure the Pallas strategies; any other strategy refuses them."""
    if name not in _REGISTRY:
        close = difflib.get_close_matches(str(name), list(_REGISTRY), n=1)
        hint = f"; did you mean {close[0]!r}?" if close else ""
        raise ValueError(f"unknown strategy {name!r}: available are {available_strategies()}{hint}")
    args = {k: kwargs.pop(k) for k in STRATEGY_ARGS if k in kwargs}
    unknown = [k for k in kwargs if k not in LossOptions.field_names()]
    if unknown:
        hints = [f"{k!r}" + (f" (did you mean {c[0]!r}?)" if (c := difflib.get_close_matches(
            k, LossOptions.field_names(), n=1)) else "") for k in unknown]
        raise TypeError(f"unknown loss option(s) {', '.join(hints)}; valid options: "
                        f"{LossOptions.field_names()}")
    if options is not None and not isinstance(options, LossOptions):
        raise TypeError(f"options must be a recloss.LossOptions, got {type(options).__name__}")
    options = (options or LossOptions()).replace(**kwargs) if kwargs else (options or LossOptions())
    factory = _REGISTRY[name]
    refused = [k for k in args if not _takes(factory, k)]
    if refused:
        takers = [n for n in available_strategies() if all(_takes(_REGISTRY[n], k) for k in refused)]
        raise TypeError(f"strategy {name!r} takes no argument(s) {', '.join(f'{k}=' for k in refused)}; "
                        f"they configure a Pallas kernel (strategies that take them: {takers})")
    return factory(options, **args)
