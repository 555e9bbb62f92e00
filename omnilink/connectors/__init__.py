"""Backend registry: built-in backends plus the ``omnilink.connectors`` entry-point group.

A backend is any callable ``factory(**options) -> Connector``. Built-ins are imported
lazily by module path so ``import omnilink`` never pays for zmq or torch.distributed.
Third parties either call ``register_backend`` or declare, in their ``pyproject.toml``::

    [project.entry-points."omnilink.connectors"]
    mybackend = "mypkg.connector:MyConnector"

The backends with parts live in a package each (``shm/``, ``zmq/``, ``nccl/``), whose
``__init__`` is its door; ``memory.py`` (the in-process reference backend) and
``base.py`` (the ``Connector`` protocol, ``BaseConnector`` and ``ConnectorStats`` that
every backend shares) sit here.
"""

from __future__ import annotations

import importlib
import logging
import threading
from importlib.metadata import entry_points
from typing import Any, Callable

from omnilink._errors import ConfigurationError, OmnilinkError
from omnilink.connectors.base import BaseConnector, Connector, ConnectorStats

__all__ = [
    "BaseConnector",
    "Connector",
    "ConnectorStats",
    "available_backends",
    "backend_factory",
    "connect",
    "register_backend",
]

logger = logging.getLogger(__name__)

ENTRY_POINT_GROUP = "omnilink.connectors"

_BUILTIN: dict[str, str] = {
    "memory": "omnilink.connectors.memory:MemoryConnector",
    "shm": "omnilink.connectors.shm:ShmConnector",
    "zmq": "omnilink.connectors.zmq:ZmqConnector",
    "nccl": "omnilink.connectors.nccl:NcclConnector",
}
_registered: dict[str, Callable[..., Connector] | str] = {}
_lock = threading.Lock()
_entry_points_loaded = False


def _load_entry_points() -> None:
    global _entry_points_loaded
    with _lock:
        if _entry_points_loaded:
            return
        _entry_points_loaded = True
        for ep in entry_points(group=ENTRY_POINT_GROUP):
            # Our own distribution declares the built-ins too; keep the built-in path.
            if ep.name in _BUILTIN or ep.name in _registered:
                continue
            _registered[ep.name] = ep.value


def register_backend(name: str, factory: Callable[..., Connector], /, *, replace: bool = False) -> None:
    """Register ``factory`` as backend ``name`` for ``connect``.

    Raises
    ------
    ConfigurationError
        ``name`` is empty, or taken and ``replace`` is false.
    """
    if not isinstance(name, str) or not name:
        raise ConfigurationError(f"backend name must be a non-empty str, got {name!r}")
    if not callable(factory):
        raise ConfigurationError(f"backend factory for {name!r} is not callable")
    _load_entry_points()
    with _lock:
        if not replace and (name in _BUILTIN or name in _registered):
            raise ConfigurationError(f"backend {name!r} is already registered")
        _registered[name] = factory


def available_backends() -> list[str]:
    """Sorted names of every backend ``connect`` knows (built-in, registered, entry points)."""
    _load_entry_points()
    with _lock:
        return sorted(set(_BUILTIN) | set(_registered))


def backend_factory(name: str, /) -> Callable[..., Connector]:
    """The factory registered for backend ``name``, its module imported on first use.

    ``connect`` calls it; the CLI and the benchmarks call it to check a backend loads.

    Raises
    ------
    ConfigurationError
        ``name`` is unknown, or its module or its dependencies cannot be imported.
    """
    _load_entry_points()
    with _lock:
        target = _registered.get(name, _BUILTIN.get(name))
    if target is None:
        raise ConfigurationError(
            f"unknown backend {name!r}; available: {', '.join(available_backends())}"
        )
    if not isinstance(target, str):
        return target
    module_name, _, attr = target.partition(":")
    try:
        module = importlib.import_module(module_name)
        return getattr(module, attr)
    except ImportError as exc:
        raise ConfigurationError(
            f"backend {name!r} could not be loaded ({exc}); install its dependencies, "
            "e.g. `pip install omnilink` brings msgspec, posix_ipc and pyzmq"
        ) from exc
    except AttributeError as exc:
        raise ConfigurationError(f"backend {name!r}: {target} does not exist") from exc


def connect(backend: str, /, **options: Any) -> Connector:
    """Open a connector of ``backend`` with backend-specific keyword options.

    Common options: ``channel`` (str, required), ``role`` (``"sender"``, ``"receiver"``
    or ``"dual"``), ``timeout`` (default seconds for blocking calls).

    Raises
    ------
    ConfigurationError
        Unknown backend or invalid options.
    """
    factory = backend_factory(backend)
    try:
        return factory(**options)
    except OmnilinkError:
        raise
    except TypeError as exc:
        raise ConfigurationError(f"invalid options for backend {backend!r}: {exc}") from exc
