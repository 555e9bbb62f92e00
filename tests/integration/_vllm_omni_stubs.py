"""Load vLLM-Omni's real connector factory and base class without vLLM.

The published ``vllm-omni`` wheel's top-level ``__init__`` imports vLLM, but its
connector modules (``connectors/base.py``, ``factory.py``, ``utils/config.py``,
``utils/logging.py``) import only each other. With ``pip install --no-deps vllm-omni``
and the parent packages put in ``sys.modules`` as namespace stubs (a module whose
``__path__`` is the real package folder), the real submodules load and the packages'
``__init__`` files, which would import vLLM, never run.

Used by ``test_vllm_omni.py`` and by its spawned workers (each process stubs for itself).
"""

from __future__ import annotations

import importlib
import importlib.util
import os
import sys
import types
from typing import Any

PIP_HINT = "pip install --no-deps vllm-omni==0.30.0"
_PARENTS = ("vllm_omni", "vllm_omni.distributed", "vllm_omni.distributed.omni_connectors")


def vllm_omni_root() -> str | None:
    """Folder of the installed ``vllm_omni`` package (not imported), or ``None``."""
    if "vllm_omni" in sys.modules:
        paths = getattr(sys.modules["vllm_omni"], "__path__", None)
        return list(paths)[0] if paths else None
    spec = importlib.util.find_spec("vllm_omni")
    if spec is None or not spec.submodule_search_locations:
        return None
    return list(spec.submodule_search_locations)[0]


def install() -> dict[str, Any]:
    """Stub the parent packages and import the real connector modules.

    Returns
    -------
    dict
        ``OmniConnectorFactory``, ``OmniConnectorBase``, ``ConnectorSpec``.

    Raises
    ------
    ImportError
        vllm-omni is not installed (the message says the pip command).
    """
    root = vllm_omni_root()
    if root is None:
        raise ImportError(f"vllm-omni is not installed; run `{PIP_HINT}`")
    for name in _PARENTS:
        if name in sys.modules:
            continue  # the real package (a vLLM machine) or an earlier stub
        mod = types.ModuleType(name)
        rel = name.split(".")[1:]
        mod.__path__ = [os.path.join(root, *rel)]  # type: ignore[attr-defined]
        mod.__package__ = name
        sys.modules[name] = mod
    factory = importlib.import_module("vllm_omni.distributed.omni_connectors.factory")
    base = importlib.import_module("vllm_omni.distributed.omni_connectors.connectors.base")
    config = importlib.import_module("vllm_omni.distributed.omni_connectors.utils.config")
    return {
        "OmniConnectorFactory": factory.OmniConnectorFactory,
        "OmniConnectorBase": base.OmniConnectorBase,
        "ConnectorSpec": config.ConnectorSpec,
    }


def install_shm_connector() -> type:
    """Import vLLM-Omni's real ``SharedMemoryConnector`` class without vLLM.

    Its module imports ``vllm_omni.entrypoints.stage_utils`` (which needs vLLM) only for
    two byte helpers its ``put``/``get`` use; a stub module stands in for it, so the class
    and its ``isinstance`` identity are the real ones (what the chunk adapter checks).
    """
    install()
    root = vllm_omni_root()
    if "vllm_omni.entrypoints.stage_utils" not in sys.modules:
        pkg = types.ModuleType("vllm_omni.entrypoints")
        pkg.__path__ = [os.path.join(root, "entrypoints")]  # type: ignore[attr-defined]
        sys.modules.setdefault("vllm_omni.entrypoints", pkg)
        utils = types.ModuleType("vllm_omni.entrypoints.stage_utils")

        def _needs_vllm(*_args: Any, **_kwargs: Any) -> Any:
            raise RuntimeError("stub: vLLM-Omni's stage_utils needs vLLM")

        utils.shm_read_bytes = _needs_vllm  # type: ignore[attr-defined]
        utils.shm_write_bytes = _needs_vllm  # type: ignore[attr-defined]
        sys.modules["vllm_omni.entrypoints.stage_utils"] = utils
    return importlib.import_module("vllm_omni.distributed.omni_connectors.connectors.shm_connector").SharedMemoryConnector


def chunk_adapter_source() -> str:
    """The text of vLLM-Omni's chunk adapter module (it imports vLLM, so it is read)."""
    root = vllm_omni_root()
    path = os.path.join(root, "distributed", "omni_connectors", "transfer_adapter", "chunk_transfer_adapter.py")
    with open(path, encoding="utf-8") as f:
        return f.read()


def create(extra: dict[str, Any]) -> Any:
    """Register omnilink with the real factory and create a connector the way vLLM-Omni
    does: ``create_connector(ConnectorSpec(name="OmnilinkConnector", extra=extra))``."""
    api = install()
    from omnilink.integrations.vllm_omni import register

    register()
    return api["OmniConnectorFactory"].create_connector(api["ConnectorSpec"](name="OmnilinkConnector", extra=extra))


# ------------------------------------------------------------------ spawn workers
WAIT = 20.0


def thinker_payload(i: int) -> dict[str, Any]:
    """A thinker -> talker chunk payload of vLLM-Omni's shape, deterministic in ``i``."""
    import torch

    hidden = torch.full((4 + i, 16), float(i), dtype=torch.bfloat16)
    return {
        "hidden_states.output": hidden,
        "hidden_states.output_shape": torch.tensor(list(hidden.shape), dtype=torch.int64),
        "embed.prefill": torch.arange(8, dtype=torch.float32) + i,
        "ids.prompt": torch.arange(5, dtype=torch.int64),
        "ids.output": torch.tensor([i], dtype=torch.int64),
        "meta.finished": torch.tensor(False),
        "speaker": "Chelsie",
    }


def stage_sender(extra: dict[str, Any], request_id: str, n_chunks: int, q: Any, done: Any) -> None:
    """Stage 0 of a pipeline: put ``n_chunks`` chunks of ``request_id`` as vLLM-Omni's chunk
    adapter does (key ``{request_id}_0_{chunk}``, the last one with ``meta.finished``),
    report ``("sent", sizes)``, wait for ``done`` and close (lingering until read)."""
    try:
        import torch

        from omnilink.chunking import chunk_key

        conn = create(extra)
        try:
            sizes = []
            for c in range(n_chunks):
                payload = thinker_payload(c)
                payload["meta.finished"] = torch.tensor(c == n_chunks - 1)
                ok, size, _md = conn.put("0", "1", chunk_key(request_id, 0, c), payload)
                if not ok:
                    raise RuntimeError(f"put of chunk {c} failed")
                sizes.append(size)
            q.put(("sent", sizes))
            if not done.wait(WAIT):
                raise RuntimeError("the test never said done")
        finally:
            conn.close()
        q.put(("closed", None))
    except BaseException as exc:  # report everything; the test decides
        q.put(("error", f"{type(exc).__name__}: {exc}"))
        raise
