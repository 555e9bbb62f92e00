"""A backend's option schema, read from the backend itself, and the check against it.

One source of truth: the names, types and defaults of a backend's options are those of
its factory's signature (``ShmConnector.__init__`` for ``shm``); nothing here repeats
them. ``check_options`` applies that schema to a dict of options without opening
anything, so a configuration (a vLLM-Omni stage's ``extra["options"]``, a deployment
file under ``omnilink check``) is refused before any process depends on it::

    factory signature            check_options(backend, options)
    -----------------            -------------------------------
    parameter names        ->    unknown name: "did you mean ...?" (difflib)
    annotations            ->    value of the wrong type: int (never bool), float (int
                                 too), str, bytes, bool, None, Literal[...] choices,
                                 unions, Iterable[...]; ``Any`` or an annotation that
                                 cannot be resolved here accepts anything
    factory.check_options  ->    what a signature cannot say (ranges, combinations):
                                 a backend may define ``check_options(options, /)``
                                 (a static- or classmethod raising ConfigurationError)

Factories that take ``**kwargs`` or whose signature cannot be read check their own
options when they are called.
"""

from __future__ import annotations

import collections.abc
import difflib
import inspect
import types
import typing
from typing import Any, Callable, Mapping

from omnilink._errors import ConfigurationError

__all__ = ["check_options", "option_schema", "unknown_option_message"]

_UNRESOLVED = object()


def option_schema(factory: Callable[..., Any]) -> dict[str, Any] | None:
    """Keyword options of ``factory`` mapped to their resolved annotation.

    ``None`` when the factory takes ``**kwargs`` or its signature cannot be read (then
    it checks its own options). An annotation that cannot be evaluated here (a name
    imported only for type checkers) maps to ``typing.Any``.
    """
    try:
        params = list(inspect.signature(factory).parameters.values())
    except (TypeError, ValueError):
        return None
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params):
        return None
    target = factory.__init__ if inspect.isclass(factory) else factory
    namespace = getattr(inspect.unwrap(target), "__globals__", {})
    schema: dict[str, Any] = {}
    for p in params:
        if p.kind not in (p.KEYWORD_ONLY, p.POSITIONAL_OR_KEYWORD):
            continue
        ann = p.annotation
        if ann is inspect.Parameter.empty:
            ann = Any
        elif isinstance(ann, str):
            try:
                ann = eval(ann, dict(namespace))  # noqa: S307 - the backend's own annotation text
            except Exception:  # a TYPE_CHECKING-only name, a newer syntax: not checkable here
                ann = Any
        schema[p.name] = ann
    return schema


def unknown_option_message(backend: str, unknown: list[str], valid: list[str]) -> str:
    """The message for option names a backend does not take, with "did you mean"."""
    parts = []
    for name in unknown:
        close = difflib.get_close_matches(name, valid, n=1, cutoff=0.6)
        parts.append(f"{name!r} (did you mean {close[0]!r}?)" if close else repr(name))
    return (
        f"unknown option{'s' if len(unknown) > 1 else ''} for backend {backend!r}: {', '.join(parts)}; "
        f"valid options: {', '.join(sorted(valid))}"
    )


def _describe(tp: Any) -> str:
    """``tp`` in words, for an error message."""
    if tp is Any:
        return "anything"
    if tp is type(None) or tp is None:
        return "None"
    origin = typing.get_origin(tp)
    if origin is typing.Literal:
        return "one of " + ", ".join(repr(a) for a in typing.get_args(tp))
    if origin in (typing.Union, types.UnionType):
        return " or ".join(_describe(a) for a in typing.get_args(tp))
    if tp is float:
        return "a number"
    if origin is not None and isinstance(origin, type) and issubclass(origin, collections.abc.Iterable):
        args = typing.get_args(tp)
        return f"a list of {_plain(args[0])}" if args else "a list"
    if isinstance(tp, type):
        article = "an" if tp.__name__[:1] in "aeiouAEIOU" else "a"
        return f"{article} {tp.__name__}"
    return str(tp)


def _plain(tp: Any) -> str:
    """``tp`` in words without an article: ``str``, ``str or bytes``."""
    if isinstance(tp, type) and typing.get_origin(tp) is None:
        return tp.__name__
    if typing.get_origin(tp) in (typing.Union, types.UnionType):
        return " or ".join(_plain(a) for a in typing.get_args(tp))
    return _describe(tp)


def matches(value: Any, tp: Any) -> bool:
    """Whether ``value`` is of annotation ``tp`` as far as a configuration file can say."""
    if tp is Any or tp is _UNRESOLVED:
        return True
    if tp is None or tp is type(None):
        return value is None
    origin = typing.get_origin(tp)
    if origin is typing.Literal:
        # 1 == True in Python: a choice matches only a value of its own type.
        return any(value == a and type(value) is type(a) for a in typing.get_args(tp))
    if origin in (typing.Union, types.UnionType):
        return any(matches(value, a) for a in typing.get_args(tp))
    if tp is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if tp is int:
        return isinstance(value, int) and not isinstance(value, bool)
    if origin is not None and isinstance(origin, type):
        if issubclass(origin, collections.abc.Iterable) and not issubclass(origin, (str, bytes, Mapping)):
            if isinstance(value, (str, bytes, Mapping)) or not isinstance(value, collections.abc.Iterable):
                return False
            args = typing.get_args(tp)
            return not args or all(matches(v, args[0]) for v in value)
        return isinstance(value, origin)
    if isinstance(tp, type):
        return isinstance(value, tp)
    return True  # a typing construct this check does not know: the factory decides


def check_options(
    backend: str,
    factory: Callable[..., Any],
    options: Mapping[str, Any],
    /,
    *,
    where: str = "",
) -> None:
    """Check ``options`` against the schema of ``factory`` (backend ``backend``).

    Parameters
    ----------
    backend : str
        The backend's name, for messages.
    factory : callable
        Its factory (``backend_factory(backend)``).
    options : mapping
        Keyword options as ``connect`` would receive them.
    where : str, optional
        Prefix of every message (``"OmnilinkConnector: extra['options']: "``).

    Raises
    ------
    ConfigurationError
        An option name the factory does not take (with the closest valid one), a value
        of the wrong type or not one of its choices, or what the factory's own
        ``check_options`` refuses.
    """
    schema = option_schema(factory)
    if schema is not None:
        unknown = [name for name in options if name not in schema]
        if unknown:
            raise ConfigurationError(where + unknown_option_message(backend, unknown, list(schema)))
        for name, value in options.items():
            tp = schema[name]
            if not matches(value, tp):
                raise ConfigurationError(
                    f"{where}option {name!r} of backend {backend!r} must be {_describe(tp)}, got {value!r}"
                )
    hook = getattr(factory, "check_options", None)
    if callable(hook):
        try:
            hook(dict(options))
        except ConfigurationError as exc:
            raise ConfigurationError(f"{where}{exc}") from exc
