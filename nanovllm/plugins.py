"""Extension points named by import path ("package.module:name"), as the engine stage's
`--scheduler-policy` and `--post-step-hook` flags take them.

Loaded once at start-up, before the model, so a name that does not resolve stops the stage at
once with an error naming the flag, the path and what went wrong.
"""
from __future__ import annotations

import importlib
from typing import Any


def load_object(spec: str, what: str) -> Any:
    """The object `spec` ("package.module:attribute") names; ValueError saying why not."""
    module_name, sep, attribute = spec.partition(":")
    if not sep or not module_name or not attribute:
        raise ValueError(f"{what} {spec!r} must look like package.module:name")
    try:
        obj: Any = importlib.import_module(module_name)
    except Exception as e:  # ImportError, or whatever the module raises while importing
        raise ValueError(f"{what} {spec!r}: cannot import {module_name!r} ({type(e).__name__}: {e})") from None
    for part in attribute.split("."):
        if not hasattr(obj, part):
            raise ValueError(f"{what} {spec!r}: {module_name!r} has no attribute {attribute!r}")
        obj = getattr(obj, part)
    return obj


def load_hook(spec: str) -> Any:
    """A post-step hook: a callable taking a `StepMetrics`."""
    hook = load_object(spec, "post-step hook")
    if not callable(hook):
        raise ValueError(f"post-step hook {spec!r} is not callable")
    return hook
