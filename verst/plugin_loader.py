"""The one loader of plug-ins: import an object by path and check it against its contract
(a `Protocol` of `verst.plugins`), with one `PluginError` naming the config field, the import
path and what is wrong."""

from __future__ import annotations

import importlib
import inspect
import os
import sys
from collections.abc import Callable
from typing import Any, Generic, Protocol


class PluginError(ValueError):
    """A plug-in that cannot be loaded or does not fit its contract. A ValueError, so a config
    validator that raises it reports the field like any other bad value."""


def load_plugin(path: str, protocol: type, *, field: str) -> Any:
    """The object named by `path`, checked against `protocol`; `PluginError` naming `field`,
    `path` and the problem when it cannot be imported or does not fit.

    A callable contract (one with `__call__`) wants a callable whose signature accepts the
    contract's arguments, and an `async def` one when the contract's `__call__` is async. Any
    other contract wants a class or an object with its methods (async where the contract's
    are); a plain function is taken as a factory of such objects, to be checked with
    `check_plugin` once built.
    """
    try:
        obj = load_object(path)
    except (ImportError, ValueError) as error:
        raise PluginError(f"{field}: {error}") from error
    if "__call__" in _members(protocol) or not _is_factory(obj, protocol):
        check_plugin(obj, protocol, field=field, path=path)
    return obj


def load_named(
    path: str, builtins: dict[str, Any], protocol: type, *, field: str, kind: str
) -> Any:
    """A built-in `kind` by bare name, or `load_plugin`'s object for an import path;
    `PluginError` naming `field` for a bare name that is no built-in."""
    if ":" in path or "." in path:
        return load_plugin(path, protocol, field=field)
    if path not in builtins:
        raise PluginError(
            f"{field}: unknown {kind} {path!r}: built-ins are "
            f"{', '.join(sorted(builtins))}; or give an import path 'pkg.mod:fn'"
        )
    return builtins[path]


def check_plugin(obj: Any, protocol: type, *, field: str, path: str) -> None:
    """Raise `PluginError` when `obj` (loaded from `path` for `field`) does not fit `protocol`."""
    members = _members(protocol)
    call = members.get("__call__")
    problem = _callable_problem(obj, call) if call is not None else _methods_problem(obj, members)
    if problem:
        name = f"{protocol.__module__}.{protocol.__qualname__}"
        raise PluginError(f"{field}: {path!r} is not a {name}: {problem}")


def load_object(path: str) -> Any:
    """Import and return the object named by `path` ('pkg.mod:name', attributes may be dotted);
    ImportError naming the path and whether the module or the attribute is missing.

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


def _members(protocol: type) -> dict[str, Callable[..., Any]]:
    """The contract's methods, in definition order: public ones, and `__call__`."""
    members: dict[str, Callable[..., Any]] = {}
    for klass in reversed(protocol.__mro__):
        if klass in (object, Generic, Protocol):
            continue
        for name, value in vars(klass).items():
            if callable(value) and (name == "__call__" or not name.startswith("_")):
                members[name] = value
    return members


def _is_factory(obj: Any, protocol: type) -> bool:
    """A plain callable without the contract's methods: it builds the object, not is it."""
    if inspect.isclass(obj) or not callable(obj):
        return False
    return any(not hasattr(obj, name) for name in _members(protocol))


def _is_async(obj: Any) -> bool:
    if inspect.iscoroutinefunction(obj):
        return True
    # an object with an `async def __call__` (a class's own __call__ builds an instance)
    return not inspect.isclass(obj) and inspect.iscoroutinefunction(type(obj).__call__)


def _callable_problem(obj: Any, call: Callable[..., Any]) -> str | None:
    if not callable(obj):
        return f"it is a {type(obj).__name__}, not callable"
    if inspect.iscoroutinefunction(call) and not _is_async(obj):
        return "it must be an `async def` function (it is awaited on the event loop)"
    params = list(inspect.signature(call).parameters.values())[1:]  # without self
    positional = [p.name for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    keywords = {p.name: p.name for p in params if p.kind is p.KEYWORD_ONLY}
    try:
        signature = inspect.signature(obj)
    except (TypeError, ValueError):  # no signature to inspect (some builtins, C callables)
        return None
    try:
        signature.bind(*positional, **keywords)
    except TypeError as error:
        wanted = ", ".join(positional + [f"*, {k}" for k in keywords])
        return f"it must take ({wanted}): {error}"
    return None


def _methods_problem(obj: Any, members: dict[str, Callable[..., Any]]) -> str | None:
    what = obj.__name__ if inspect.isclass(obj) else f"a {type(obj).__name__} object"
    missing = [name for name in members if not callable(getattr(obj, name, None))]
    if missing:
        return f"{what} lacks {', '.join(missing)}"
    for name, method in members.items():
        if inspect.iscoroutinefunction(method) and not inspect.iscoroutinefunction(
            getattr(obj, name)
        ):
            return f"{what}.{name} must be an async method"
    return None
