"""Load vLLM-Omni's own ``SharedMemoryConnector`` without vLLM (a baseline being measured).

``omnilink bench pipeline --connector vllm-omni-shm`` runs the pipeline through the
connector vLLM-Omni 0.30.0 gives every stage edge by default: the real class from the
installed ``vllm-omni`` wheel (``pip install --no-deps vllm-omni==0.30.0``, which
``make setup`` does), with its real serializer (``OmniSerializer``: msgspec msgpack,
each tensor copied to host bytes) and its real segment helpers (``shm_write_bytes`` /
``shm_read_bytes``: a fresh ``SharedMemory`` segment per payload, named by the key).

The wheel's package ``__init__`` files import vLLM. As in the integration tests, the
parent packages are put in ``sys.modules`` as namespace stubs (modules whose
``__path__`` is the real folder), so the real submodules load and those ``__init__``
files never run. Where vLLM itself is not installed, four names the loaded modules
import at their top but never call on this path get placeholders: ``vllm.outputs``
(``RequestOutput`` / ``CompletionOutput``, only compared with ``isinstance`` by the
serializer, which no pipeline payload matches), ``vllm_omni.config.yaml_util`` and
``vllm_omni.platforms`` (used by other functions of ``entrypoints/stage_utils.py``, not
by the two segment helpers), and ``PIL.Image`` when Pillow is missing. The code that
runs per chunk (``put``, ``get``, serializer, segment helpers) is vLLM-Omni's own.
"""

from __future__ import annotations

import importlib
import importlib.util
import os
import sys
import types
from typing import Any

__all__ = ["PIP_HINT", "load_nixl_connector", "load_shared_memory_connector", "probe"]

PIP_HINT = "pip install --no-deps vllm-omni==0.30.0"
_PARENTS = (
    "vllm_omni",
    "vllm_omni.distributed",
    "vllm_omni.distributed.omni_connectors",
    "vllm_omni.distributed.omni_connectors.connectors",
    "vllm_omni.distributed.omni_connectors.utils",
    "vllm_omni.entrypoints",
    "vllm_omni.config",
)


def _root() -> str | None:
    if "vllm_omni" in sys.modules:
        paths = getattr(sys.modules["vllm_omni"], "__path__", None)
        return list(paths)[0] if paths else None
    try:
        spec = importlib.util.find_spec("vllm_omni")
    except (ImportError, ValueError):
        return None
    if spec is None or not spec.submodule_search_locations:
        return None
    return list(spec.submodule_search_locations)[0]


def probe() -> str | None:
    """``None`` when the connector can be loaded here, else why not (with the pip hint)."""
    root = _root()
    if root is None:
        return f"vllm-omni is not installed; run `{PIP_HINT}`"
    path = os.path.join(root, "distributed", "omni_connectors", "connectors", "shm_connector.py")
    if not os.path.exists(path):
        return f"the installed vllm-omni has no SharedMemoryConnector ({path}); run `{PIP_HINT}`"
    return None


def _placeholder(name: str, **attrs: Any) -> None:
    if name in sys.modules:
        return
    mod = types.ModuleType(name)
    mod.__dict__.update(attrs)
    sys.modules[name] = mod


def _importable(name: str) -> bool:
    try:
        return importlib.util.find_spec(name) is not None
    except (ImportError, ValueError):
        return False


def load_shared_memory_connector() -> Any:
    """Return vLLM-Omni's ``SharedMemoryConnector`` class (call in the process that uses it).

    Raises
    ------
    ImportError
        vllm-omni is not installed or lacks the connector (the message says the pip
        command).
    """
    reason = probe()
    root = _root()
    if reason is not None or root is None:
        raise ImportError(reason or f"vllm-omni is not installed; run `{PIP_HINT}`")
    have_vllm = _importable("vllm")
    for name in _PARENTS:
        if name in sys.modules:
            continue  # the real package (a vLLM machine) or an earlier stub
        mod = types.ModuleType(name)
        mod.__path__ = [os.path.join(root, *name.split(".")[1:])]  # type: ignore[attr-defined]
        mod.__package__ = name
        sys.modules[name] = mod
    if not have_vllm:
        class RequestOutput:  # placeholder: never matched by a pipeline payload
            pass

        class CompletionOutput:  # placeholder: never matched by a pipeline payload
            pass

        _placeholder("vllm")
        _placeholder("vllm.outputs", RequestOutput=RequestOutput, CompletionOutput=CompletionOutput)
        _placeholder("vllm_omni.platforms", current_omni_platform=None)

        def to_dict(obj: Any) -> Any:  # placeholder: stage_utils' config helpers only
            raise NotImplementedError("vllm_omni.config.yaml_util is a placeholder here")

        if not _importable("omegaconf"):
            _placeholder("vllm_omni.config.yaml_util", to_dict=to_dict)
    if not _importable("PIL"):
        class Image:  # placeholder: never matched by a pipeline payload
            pass

        _placeholder("PIL", __path__=[])
        _placeholder("PIL.Image", Image=Image)
    mod = importlib.import_module("vllm_omni.distributed.omni_connectors.connectors.shm_connector")
    return mod.SharedMemoryConnector


#: NIXL's builds, in the order the ``nixl`` package itself tries them without CUDA.
_NIXL_BUILDS = ("nixl_cu13", "nixl_cu12")


def _nixl_api() -> Any:
    """NIXL's ``_api`` module as ``nixl._api``. Where only a CUDA build is installed
    (``pip install nixl-cu13``: no ``nixl`` package, which only forwards to one), ``nixl``
    and ``nixl._api`` are made that build's, as the ``nixl`` package makes them: its
    ``_bindings`` and ``_api`` names under ``nixl`` (vLLM-Omni's connector imports
    ``nixl_thread_sync_t`` from ``nixl``).

    Raises
    ------
    ImportError
        No NIXL build is installed.
    """
    try:
        return importlib.import_module("nixl._api")
    except ImportError as exc:
        first = exc
    for build in _NIXL_BUILDS:
        try:
            bindings = importlib.import_module(f"{build}._bindings")
            api = importlib.import_module(f"{build}._api")
        except ImportError:
            continue
        alias = types.ModuleType("nixl")
        for sub in (bindings, api):
            alias.__dict__.update({k: v for k, v in vars(sub).items() if not k.startswith("__")})
        alias._api = api
        alias._bindings = bindings
        sys.modules["nixl"] = alias
        sys.modules["nixl._api"] = api
        sys.modules["nixl._bindings"] = bindings
        return api
    raise first


def load_nixl_connector() -> Any:
    """Return vLLM-Omni's ``NixlConnector`` class, loaded as ``load_shared_memory_connector``
    loads its shm connector (call in the process that uses it).

    The class imports ``NixlWrapper`` and ``nixl_agent_config`` from vLLM's
    ``vllm.distributed.nixl_utils``; where vLLM is not installed that module is a
    placeholder holding what vLLM puts there, NIXL's own ``nixl._api.nixl_agent`` and
    ``nixl_agent_config`` (``_nixl_api``: from NIXL's CUDA build where the ``nixl``
    package is missing). Everything the connector does per put and get is its own.

    Raises
    ------
    ImportError
        vllm-omni or NIXL is not installed (the message says what to install).
    """
    load_shared_memory_connector()  # the package stubs and placeholders
    if not _importable("vllm.distributed.nixl_utils"):
        try:
            api = _nixl_api()
        except ImportError as exc:
            raise ImportError(f"vLLM-Omni's NixlConnector needs NIXL: {exc}; run `pip install nixl`") from exc
        nixl_agent, nixl_agent_config = api.nixl_agent, api.nixl_agent_config
        _placeholder("vllm.distributed", __path__=[])
        _placeholder("vllm.distributed.nixl_utils", NixlWrapper=nixl_agent, nixl_agent_config=nixl_agent_config)
    mod = importlib.import_module("vllm_omni.distributed.omni_connectors.connectors.nixl_connector")
    return mod.NixlConnector
