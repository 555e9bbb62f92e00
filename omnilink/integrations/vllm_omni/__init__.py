"""vLLM-Omni integration: ``OmnilinkConnector`` for ``OmniConnectorFactory``.

vLLM-Omni moves stage outputs (thinker hidden states, talker codec frames, ...) through
a connector named in the stage config. ``OmnilinkConnector`` is such a connector: it
keeps vLLM-Omni's contract (below) and carries every payload with an omnilink backend
(``shm`` by default), so payloads travel as tensor_blob frames, never pickled, and are
received as zero-copy views of the transport buffer.

vLLM-Omni's connector contract (``OmniConnectorBase`` in
``vllm_omni.distributed.omni_connectors.connectors.base``, 0.30.0), which this class keeps:

- ``put(from_stage, to_stage, put_key, data) -> (success, size_in_bytes, metadata)``;
  on failure ``(False, 0, None)``, never an exception.
- ``get(from_stage, to_stage, get_key, metadata=None) -> (data, size) | None``; never
  blocks and never raises for a missing key: ``None`` means "not there yet" and the
  caller polls. ``metadata`` is what ``put`` returned, a dict keyed by ``get_key``
  holding it, or ``None`` (the chunk adapter never forwards it).
- Reads consume: exactly one reader gets a payload.
- ``cleanup(request_id)``, ``health() -> dict``, an idempotent ``close()``, a context
  manager; attributes ``supports_raw_data``, ``stage_id`` and ``config`` (the ``extra``
  dict: stage processors read ``codec_chunk_frames``, ``codec_left_context_frames``
  and ``initial_codec_chunk_frames`` from it).
- ``OmniConnectorFactory.create_connector(ConnectorSpec(name, extra))`` calls
  ``constructor(extra)`` after injecting ``extra["stage_id"]`` and ``extra["role"]``.
- Payloads that travel today (top-level dotted keys, tensor values): thinker -> talker
  ``hidden_states.output``, ``hidden_states.output_shape``, ``embed.prefill``,
  ``ids.prompt``, ``ids.output``; talker -> code2wav ``codes.audio`` (1-D int64,
  codebook-major) and ``meta.finished`` (0-d bool); some carry plain metadata (speaker,
  language). Chunk keys are ``{request_id}_{from_stage}_{chunk_id}``.

Registration::

    from omnilink.integrations.vllm_omni import register
    register()          # OmniConnectorFactory now knows "OmnilinkConnector"

vLLM-Omni calls ``register`` itself at start-up in every process (API server, engine
core, workers) through the ``vllm_omni.general_plugins`` entry point that omnilink
declares, so a deploy config only has to define the connector and, on every stage
that receives, name it in ``input_connectors`` (an edge no stage names gets vLLM-Omni's
default ``SharedMemoryConnector``; ``examples/vllm_omni/qwen3_omni_omnilink.yaml`` is
a complete file)::

    connectors:
      omnilink_shm:
        name: OmnilinkConnector
        extra: {backend: shm, codec_chunk_frames: 25, codec_left_context_frames: 25,
                initial_codec_chunk_frames: 4}
    stages:
      - stage_id: 0
      - stage_id: 1
        input_connectors: {from_stage_0: omnilink_shm}
      - stage_id: 2
        input_connectors: {from_stage_1: omnilink_shm}

How one adapter maps onto omnilink connectors::

    vLLM-Omni call                       omnilink
    --------------                       --------
    put("0", "1", key, data)   ------>   connect(backend, channel="<channel>/0-1",
                                                 role="sender").put(key, blob)
    get("0", "1", key, md)     ------>   connect(backend, channel="<channel>/0-1",
                                                 role="receiver").get_nowait(key)
                                         WouldBlock -> None ("not there yet")

One omnilink connector is opened per stage edge and direction, on first use (or at
construction for the edge named by ``extra["from_stage"]``/``extra["to_stage"]``,
which vLLM-Omni injects with the role). A ``put`` always opens the sending side of its
edge and a ``get`` the receiving side, whatever ``role`` says: a middle stage receives
on one edge and sends on the next through the same adapter.

Checking a deployment without vLLM (``omnilink check FILE``; module ``check``):
``check_file`` / ``check_config`` read a deploy file as vLLM-Omni 0.30.0 does and report
each stage edge's connector, running ``check_extra`` (module ``config``, the check the
connector itself runs at construction) on every omnilink edge; ``plugin_status`` says
whether ``VLLM_PLUGINS`` lets vLLM-Omni load the plugin (``omnilink info``).

Versions and contract: written against vLLM-Omni 0.30.0 and tested with its real
``OmniConnectorFactory`` and ``OmniConnectorBase``. It follows 0.30.0's cleanup contract:
``cleanup(key)`` frees exactly the payload put under ``key`` ("a raw request id is not an
exact key and must not match any chunks"); the sweep of every chunk of a request is the
separate method ``cleanup_request(request_id)``, which vLLM-Omni never calls and which is
for callers that know every chunk of the request is garbage.

Per-request bookkeeping, and what ``cleanup`` and ``cleanup_request`` free::

    put(key)       -> index[request_id] += ("sender", channel, key)
    get(key)=None  -> index[request_id] += ("receiver", channel, key)   (polled, not read)
    get(key)=data  -> index entry of key removed (consumed)
    abandon_get(k) -> the polled entry of k forgotten (the payload is left alone)
    cleanup(key)   -> discard exactly key, wherever it is still unread on this adapter
    cleanup_request(rid)
                   -> discard every indexed key of rid (and the key rid itself); on each
                      receiving edge also discard the chunks {rid}_{from}_{c} that came
                      after the last one polled, while they are there
    every second   -> sent keys a receiver claimed are forgotten (the backend's
                      ``pending_keys``); entries older than ``pending_ttl``: sent payloads
                      still unread are discarded, polled ones forgotten

``request_id`` of a key: the request id of a chunk key ``{request_id}_{from_stage}_{chunk}``
(``omnilink.chunking.parse_chunk_key``, stage matching the edge), else the key itself.

Configuration (the connector's ``extra`` dict, kept as ``config``):

==========================  ===========================================================
``backend``                 omnilink backend (default ``"shm"``)
``channel``                 channel prefix (default ``"vllm-omni"``); give each
                            deployment on a host its own
``options``                 dict of backend options for ``omnilink.connect``
                            (``arena_bytes``, ``timeout``, ``endpoint``, ...)
``put_timeout``             seconds ``put`` waits for room (backpressure) before it
                            reports failure (default 10.0)
``zero_copy``               ``True`` (default): received tensors are views of the
                            transport buffer, its block is handed back when the last view
                            dies; ``False``: copy and release at once
``device``                  land received tensors there (e.g. ``"cuda:0"``); with ``shm``
                            by DMA on a copy stream the caller's current stream waits on
``pending_ttl``             seconds after which unread payloads are dropped (default
                            1800; ``None``: never). vLLM-Omni fails a request that
                            waited 600 s for input, so older payloads are orphans
``max_tracked_keys``        bound of the per-request index (default 65536)
``hold_warn_s``             a request that has held a received payload's views (its
                            arena block) longer than this is logged, once (default
                            120; ``None``: never)
``reclaim_after``           ``shm`` only: seconds after which an unread payload may be
                            reclaimed when the arena is full (default: the engine's
                            ``VLLM_OMNI_INPUT_WAIT_TIMEOUT_S``, 600 when unset; ``None``
                            or that variable at 0: never). See "Aborted requests"
``codec_chunk_frames``,     read by vLLM-Omni's stage processors; checked here to be
``codec_left_context_``     ints (>= 1, >= 0, >= 1)
``frames``, ``initial_``
``codec_chunk_frames``
``stage_id``, ``role``,     injected by vLLM-Omni (role ``sender``, ``receiver``, ``dual``)
``from_stage``, ``to_stage``
``pass_through``            list of further key names to accept as they are: keys a
                            newer vLLM-Omni or a custom stage processor reads from
                            ``extra`` (0.30.0's own, ``codec_chunk_ramp`` and the like,
                            are known: ``config.VLLM_OMNI_KEYS``)
==========================  ===========================================================

The whole ``extra`` is checked at construction, for every role (``config.check_extra``):
an unknown key is a ``ConfigurationError`` naming it with the closest known key ("did
you mean 'put_timeout'?"); values are type- and range-checked; ``options`` is checked
against the backend's own signature (names with "did you mean", types, choices) and
its ``check_options`` (the ranges and combinations its constructor refuses), for each
side the stage opens (a ``"dual"`` stage: sender and receiver); a backend that cannot
be used in this process (``cuda_ipc`` without CUDA) or a ``device``
it does not have is refused. ``omnilink check FILE`` runs the same check on every
omnilink edge of a deployment file, without vLLM.

Aborted requests (a cancelled stream, a timeout, a client that went away) leave chunks
nobody will read. Three things give their memory back:

1. The engine's abort path. vLLM-Omni 0.30.0's chunk adapter calls the exact-key
   ``cleanup`` for every chunk of an aborted request only for a ``SharedMemoryConnector``;
   ``register`` makes this class a virtual subclass of it (where vLLM is installed), so
   the adapter does the same for omnilink.
2. Reclaim under pressure, with no help from the engine. When a ``put`` finds the
   ``shm`` arena full, it first drops payloads no receiver has claimed, published more
   than ``reclaim_after`` seconds ago and read past (the receivers have since claimed a
   payload published after them), oldest first, only as many as it needs. Each is
   logged with its key and age and counted (``health()["reclaimed"]``, the edge's
   ``stats().reclaimed``). A payload a receiver holds is never touched; a receiver that
   is stalled, or behind and reading in publication order, loses nothing; and the
   default age is the engine's own input wait timeout: vLLM-Omni fails a request whose
   stage waited that long for input, so a chunk left behind for longer belongs to a
   dead request (the assumption: a live receiver does not leave a chunk of a live
   request unread for that long while it reads later ones).
3. Receivers that died. A ``put`` that has to wait for room while every receiver of its
   edge is dead gets ``PeerLostError`` from the backend; the adapter logs it for the
   edge, counts it (``health()["peer_lost"]``), reclaims every unread payload of the
   edge (their requests died with the receiver) and reports the put as failed. A
   receiver started afterwards carries on with new requests.

``pending_ttl`` stays the backstop for backends without an arena.

Payloads: whatever tensor_blob carries (dicts with dotted keys such as ``codes.audio``
and ``meta.finished``, tensors of any dtype and device, numpy arrays, plain values), plus
``msgspec.Struct`` and dataclass instances (``OmniPayloadStruct``), which are sent as the
dicts msgspec would make of them (fields left at their default omitted when the struct
says ``omit_defaults``), exactly what vLLM-Omni's own serializer delivers.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

from omnilink._errors import ConfigurationError
from omnilink.integrations.vllm_omni.check import (
    CheckUsageError,
    EdgeReport,
    FileReport,
    check_config,
    check_file,
    format_report,
    load_deploy_file,
)
from omnilink.integrations.vllm_omni.config import (
    _FACTORY_MODULE,
    CONNECTOR_NAME,
    ExtraSettings,
    check_extra,
    import_failure,
    plugin_status,
)
from omnilink.integrations.vllm_omni.connector import _connector_class, _load_base, _wire_abort_cleanup

if TYPE_CHECKING:  # pragma: no cover
    from omnilink.integrations.vllm_omni.connector import _OmnilinkConnectorImpl

__all__ = [
    "CONNECTOR_NAME",
    "CheckUsageError",
    "EdgeReport",
    "ExtraSettings",
    "FileReport",
    "OmnilinkConnector",
    "check_config",
    "check_extra",
    "check_file",
    "format_report",
    "load_deploy_file",
    "plugin_status",
    "register",
]

logger = logging.getLogger(__name__)


def register(factory: Any = None) -> type:
    """Register ``OmnilinkConnector`` with vLLM-Omni's ``OmniConnectorFactory``.

    Idempotent: a factory that already maps ``"OmnilinkConnector"`` to this class is left
    as it is. vLLM-Omni calls this in every process at start-up through the
    ``vllm_omni.general_plugins`` entry point.

    Where vLLM-Omni's ``SharedMemoryConnector`` module imports (with vLLM), this also
    wires the engine's abort path: the class becomes a virtual subclass of
    ``SharedMemoryConnector``, so the chunk adapter queues the exact-key ``cleanup`` of an
    aborted request's unread chunks for it as it does for its own connector.

    Parameters
    ----------
    factory : type, optional
        The factory class; default ``vllm_omni.distributed.omni_connectors.factory.
        OmniConnectorFactory``.

    Returns
    -------
    type
        The ``OmnilinkConnector`` class.

    Raises
    ------
    ConfigurationError
        vLLM-Omni cannot be imported (the message says what to install), the class was
        built before vLLM-Omni was importable, or the name is taken by another connector.
    """
    if factory is None:
        import importlib

        try:
            factory = importlib.import_module(_FACTORY_MODULE).OmniConnectorFactory
        except ImportError as exc:
            raise ConfigurationError(import_failure(exc)) from exc
    cls = _connector_class()
    base = _load_base()
    if base is object or not issubclass(cls, base):
        raise ConfigurationError(
            "OmnilinkConnector was built before vLLM-Omni was importable and does not subclass "
            "OmniConnectorBase; import vLLM-Omni before omnilink.integrations.vllm_omni"
        )
    _wire_abort_cleanup(cls)
    registry = getattr(factory, "_registry", None)
    if isinstance(registry, dict) and registry.get(CONNECTOR_NAME) is cls:
        return cls
    try:
        factory.register_connector(CONNECTOR_NAME, cls)
    except ValueError as exc:
        current = registry.get(CONNECTOR_NAME) if isinstance(registry, dict) else None
        if current is cls:  # registered meanwhile by another thread
            return cls
        raise ConfigurationError(
            f"{CONNECTOR_NAME!r} is already registered with {factory.__name__} as {current!r}: {exc}"
        ) from exc
    logger.debug("registered %s with %s", CONNECTOR_NAME, factory.__name__)
    return cls


def __getattr__(name: str) -> Any:
    # Built on first use: vLLM-Omni (and with it vLLM) is imported only then.
    if name == "OmnilinkConnector":
        return _connector_class()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


if TYPE_CHECKING:  # pragma: no cover - for type checkers only

    class OmnilinkConnector(_OmnilinkConnectorImpl):
        ...
