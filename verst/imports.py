"""Plug-in loading: turn an import path (`pkg.mod:name` or `pkg.mod.name`) into the object.

Every replaceable part (reward, rollout function, filter, data buffer, ...) is named in config
by such a path. Errors name the path and say whether the module or the attribute was missing.
"""

from __future__ import annotations

import importlib
import os
import sys
from typing import Any


def _split(path: str) -> tuple[str, str]:
    if ":" in path:
        module_name, _, attr = path.partition(":")
    else:
        module_name, _, attr = path.rpartition(".")
    if not module_name or not attr:
        raise ValueError(
            f"import path {path!r} is not of the form 'pkg.mod:name' (or 'pkg.mod.name')"
        )
    return module_name, attr


def load_object(path: str) -> Any:
    """Import and return the object named by `path` ('pkg.mod:name', attributes may be dotted).

    Modules are looked up on sys.path and in the current directory, as `python -m` would, so
    a `my_rewards.py` beside the config works from the `verst` command too.
    """
    module_name, attr = _split(path.strip())
    if os.getcwd() not in sys.path:
        sys.path.append(os.getcwd())
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as exc:
        # A module that exists but imports something missing is a different failure to report.
        missing = exc.name or module_name
        if missing != module_name and not module_name.startswith(missing + "."):
            raise ImportError(
                f"cannot load {path!r}: importing module {module_name!r} failed: {exc}"
            ) from exc
        raise ImportError(f"cannot load {path!r}: module {module_name!r} not found") from exc
    obj: Any = module
    for part in attr.split("."):
        try:
            obj = getattr(obj, part)
        except AttributeError as exc:
            raise ImportError(
                f"cannot load {path!r}: module {module_name!r} has no attribute {attr!r}"
            ) from exc
    return obj
