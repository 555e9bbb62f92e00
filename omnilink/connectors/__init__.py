"""Backend registry: built-in backends plus the ``omnilink.connectors`` entry-point group.

A backend is any callable ``factory(**options) -> Connector``. Built-ins are imported
lazily by module path so ``import omnilink`` never pays for zmq or torch.distributed.
Third parties either call ``register_backend`` or declare, in their ``pyproject.toml``::

    [project.entry-points."omnilink.connectors"]
    mybackend = "mypkg.connector:MyConnector"

A backend that needs something a process may lack (``cuda_ipc``: a CUDA device and
cuda-python; ``nixl``: NIXL) has a ``unavailable_reason()`` on its factory; ``backend_unavailable(name)``
returns that reason (``omnilink info`` shows it), and ``connect`` raises it as an error.

Opening: ``connect("shm", ...)`` is typed per built-in backend (an overload each, no
catch-all, so a type checker rejects a misspelt backend or option); a third party's
backend, or a name known only at run time, opens with ``connect_backend(name, ...)``.
A backend's option schema is its factory's signature (``_options.py``):
``check_backend_options(name, options)`` applies it without opening anything, plus the
factory's own ``check_options(options)`` where it defines one: every built-in backend
does, with the value checks its constructor runs (ranges, combinations; one function
called from both), leaving what needs the machine (free ``/dev/shm``, a CUDA device)
to the constructor and ``omnilink check``.

The backends with parts live in a package each (``shm/``, ``zmq/``, ``nccl/``,
``cuda_ipc/``, ``nixl/``), whose
``__init__`` is its door; ``memory.py`` (the in-process reference backend) and
``base.py`` (the ``Connector`` protocol, ``BaseConnector`` and ``ConnectorStats`` that
every backend shares) sit here. Two packages here are no backends but what the
same-host ones build on, below them: ``shmem/`` (names, segments and the allocator of
``/dev/shm``) and ``devpool/`` (the receiver-owned CUDA IPC pool and its two ends, used
by ``cuda_ipc`` and by ``shm``'s device-IPC route; it imports neither); and ``bell.py``, a
doorbell (length-prefixed messages on a plain stream socket, no I/O thread) that the
``nccl`` and ``nixl`` backends use for their per-payload messages.
"""

from __future__ import annotations

import importlib
import logging
import threading
from collections.abc import Iterable
from importlib.metadata import entry_points
from typing import TYPE_CHECKING, Any, Callable, Literal, overload

from omnilink._errors import ConfigurationError, OmnilinkError
from omnilink.connectors._options import check_options, option_schema, unknown_option_message
from omnilink.connectors.base import BaseConnector, Connector, ConnectorStats, Role

if TYPE_CHECKING:  # pragma: no cover - for type checkers and IDEs only: no import cost
    from omnilink.connectors.cuda_ipc import CudaIpcConnector
    from omnilink.connectors.memory import MemoryConnector
    from omnilink.connectors.nccl import NcclConnector
    from omnilink.connectors.nixl import NixlConnector
    from omnilink.connectors.shm import ShmConnector
    from omnilink.connectors.zmq import ZmqConnector

__all__ = [
    "BaseConnector",
    "Connector",
    "ConnectorStats",
    "available_backends",
    "backend_factory",
    "backend_unavailable",
    "check_backend_options",
    "connect",
    "connect_backend",
    "register_backend",
]

logger = logging.getLogger(__name__)

ENTRY_POINT_GROUP = "omnilink.connectors"

_BUILTIN: dict[str, str] = {
    "memory": "omnilink.connectors.memory:MemoryConnector",
    "shm": "omnilink.connectors.shm:ShmConnector",
    "zmq": "omnilink.connectors.zmq:ZmqConnector",
    "nccl": "omnilink.connectors.nccl:NcclConnector",
    "cuda_ipc": "omnilink.connectors.cuda_ipc:CudaIpcConnector",
    "nixl": "omnilink.connectors.nixl:NixlConnector",
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
            "e.g. `pip install pyomnilink` brings msgspec, posix_ipc and pyzmq"
        ) from exc
    except AttributeError as exc:
        raise ConfigurationError(f"backend {name!r}: {target} does not exist") from exc


def backend_unavailable(name: str, /) -> str | None:
    """Why backend ``name`` cannot be used in this process, or ``None`` when it can.

    The reason is the load error, or what the backend's ``unavailable_reason()`` says
    (``cuda_ipc`` without a CUDA device or cuda-python). Never initialises CUDA.
    """
    try:
        factory = backend_factory(name)
    except OmnilinkError as exc:
        return str(exc)
    probe = getattr(factory, "unavailable_reason", None)
    if not callable(probe):
        return None
    try:
        reason = probe()
    except Exception as exc:  # a third party's probe: report, never raise
        return f"{type(exc).__name__}: {exc}"
    return None if reason is None else str(reason)


# One overload per built-in backend, so IDEs and type checkers see each backend's options
# (``arena_bytes`` for shm, ``endpoint`` for zmq, ...) and the class ``connect`` returns.
# The defaults are the backends' own (see each class's docstring). There is no catch-all
# overload: it would absorb a misspelt name ("shmm") or option; third-party backends
# and run-time names go through ``connect_backend``.
@overload
def connect(
    backend: Literal["memory"],
    /,
    *,
    channel: str,
    role: Role = "dual",
    timeout: float | None = None,
    capacity_bytes: int | None = None,
) -> MemoryConnector: ...


@overload
def connect(
    backend: Literal["shm"],
    /,
    *,
    channel: str,
    role: Role = "dual",
    timeout: float | None = None,
    arena_bytes: int | None = None,
    max_inflight: int = ...,
    overflow: Literal["segment", "error"] = "segment",
    linger: float = ...,
    spin_us: int = ...,
    max_bytes: int | None = None,
    shrink_after: float = ...,
    reclaim_after: float | None = None,
    pipeline_bytes: int = ...,
    slice_bytes: int = ...,
    device_ipc: Literal["auto", "on", "off"] = "auto",
    ipc_pool_bytes: int = ...,
    ipc_min_bytes: int | None = ...,
    ipc_device: Any = None,
    ipc_pool_max_bytes: int | None = None,
) -> ShmConnector: ...


@overload
def connect(
    backend: Literal["zmq"],
    /,
    *,
    channel: str,
    role: Role = "dual",
    timeout: float | None = None,
    endpoint: str | None = None,
    ipc_dir: str | None = None,
    sndhwm: int = 16,
    rcvhwm: int = 16,
    max_buffered_bytes: int = ...,
    copy_threshold: int = ...,
    heartbeat_interval: float = 1.0,
    peer_timeout: float = 5.0,
    reconnect_interval: float = 0.1,
    max_frame_bytes: int | None = None,
    by_reference: bool = True,
    reference_threshold: int = ...,
    curve_secret_key: str | bytes | None = None,
    curve_server_key: str | bytes | None = None,
    curve_allowed_clients: Iterable[str | bytes] | None = None,
) -> ZmqConnector: ...


@overload
def connect(
    name: Literal["nccl"],  # positional-only: ``backend=`` below is nccl's own option
    /,
    *,
    channel: str,
    role: Role = "dual",
    timeout: float | None = None,
    backend: Literal["auto", "nccl", "gloo"] = "auto",
    rank: int | None = None,
    world_size: int = 2,
    device: Any = None,
    store: Any = None,
    master_addr: str = "127.0.0.1",
    master_port: int | None = None,
    connect_timeout: float = 60.0,
    send_window: int = 64,
    max_inflight_bytes: int = ...,
    max_pending_bytes: int = ...,
    inline_bytes: int | None = None,
    max_inline_bytes: int = ...,
    max_message_bytes: int = ...,
    coalesce: bool = True,
    pack_bytes: int = ...,
    header_addr: str | None = None,
    bell_bytes: int = ...,
    spin_us: int = ...,
    templates: bool = False,
) -> NcclConnector: ...


@overload
def connect(
    backend: Literal["cuda_ipc"],
    /,
    *,
    channel: str,
    role: Role = "dual",
    timeout: float | None = None,
    device: Any = None,
    pool_bytes: int = ...,
    pool_max_bytes: int | None = None,
    event_slots: int = ...,
    max_blocks: int = ...,
    arena_bytes: int = ...,
    linger: float = ...,
) -> CudaIpcConnector: ...


@overload
def connect(
    backend: Literal["nixl"],
    /,
    *,
    channel: str,
    role: Role = "dual",
    timeout: float | None = None,
    endpoint: str | None = None,
    pool_bytes: int = ...,
    extent_bytes: int = ...,
    device: Any = None,
    heartbeat_interval: float = 1.0,
    peer_timeout: float = 5.0,
    spin_us: int = ...,
) -> NixlConnector: ...


def connect(backend: str, /, **options: Any) -> Connector:
    """Open a connector of built-in ``backend`` with backend-specific keyword options.

    Common options: ``channel`` (str, required), ``role`` (``"sender"``, ``"receiver"``
    or ``"dual"``), ``timeout`` (default seconds for blocking calls). The options of
    each built-in backend are those of its class (``ShmConnector``, ``ZmqConnector``,
    ``NcclConnector``, ``MemoryConnector``, ``CudaIpcConnector``), and ``connect`` is
    typed per backend name: a type checker rejects a misspelt backend or option, a
    bad ``role`` and a value of the wrong type. Backends of other packages (entry
    points, ``register_backend``) and names known only at run time open with
    ``connect_backend(name, ...)``; ``connect`` opens them too at run time, but a
    type checker only accepts the built-in names here.

    Raises
    ------
    ConfigurationError
        Unknown backend; an option the backend does not take (with the closest valid
        name: "did you mean ...") or an invalid value.
    """
    return _open(backend, options)


def connect_backend(name: str, /, **options: Any) -> Connector:
    """Open a connector of any backend by name: a third party's or one chosen at run time.

    The same as ``connect`` at run time, typed for any ``str``: the options are not
    checked by a type checker but by the backend's signature when called (unknown
    names are refused with "did you mean ...").

    Parameters
    ----------
    name : str
        A name ``available_backends()`` lists (built-in, ``register_backend``, or the
        ``omnilink.connectors`` entry-point group).
    **options
        The backend's keyword options (``channel``, ``role``, ``timeout``, ...).

    Returns
    -------
    Connector

    Raises
    ------
    ConfigurationError
        Unknown backend; an option the backend does not take or an invalid value.
    """
    return _open(name, options)


def _open(backend: str, options: dict[str, Any]) -> Connector:
    factory = backend_factory(backend)
    _check_option_names(backend, factory, options)
    try:
        return factory(**options)
    except OmnilinkError:
        raise
    except TypeError as exc:
        raise ConfigurationError(f"invalid options for backend {backend!r}: {exc}") from exc


def _check_option_names(backend: str, factory: Callable[..., Any], options: dict[str, Any]) -> None:
    """Refuse option names ``factory`` does not take, suggesting the closest valid one.

    Names only: the values are the factory's to check when it is called (``connect``
    keeps what the backends accept). ``check_backend_options`` checks the values too.
    Factories whose signature cannot be read, or that take ``**kwargs``, are left to
    check their own options.
    """
    schema = option_schema(factory)
    if schema is None:
        return
    unknown = [name for name in options if name not in schema]
    if unknown:
        raise ConfigurationError(unknown_option_message(backend, unknown, list(schema)))


def check_backend_options(backend: str, options: dict[str, Any], /, *, where: str = "") -> None:
    """Check ``options`` for backend ``backend`` without opening anything.

    The schema is the backend's own: its factory's signature (names, and types from
    its annotations: ints, numbers, strings, ``Literal`` choices, ``None``) and, where
    the factory defines it, its ``check_options(options)`` hook for what a signature
    cannot say (every built-in backend's refuses exactly the values its constructor
    refuses before opening anything; options left out take the constructor's
    defaults, ``role`` included). ``connect`` takes the same names. The vLLM-Omni
    adapter and ``omnilink check`` call this to refuse a bad configuration before a
    process depends on it.

    Parameters
    ----------
    backend : str
        A backend name ``available_backends()`` lists.
    options : dict
        The keyword options ``connect`` would get (``channel`` and ``role`` included or
        not).
    where : str, optional
        Prefix for the error message (where the options came from).

    Raises
    ------
    ConfigurationError
        Unknown backend, a backend that cannot be loaded, an unknown option name (with
        "did you mean"), a value of the wrong type or outside its choices, or one the
        backend's ``check_options`` refuses (out of range, a combination that cannot
        work); the message names the option.
    """
    factory = backend_factory(backend)
    check_options(backend, factory, options, where=where)
