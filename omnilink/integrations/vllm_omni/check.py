"""``omnilink check``: a vLLM-Omni deployment file, edge by edge, without vLLM or a GPU.

vLLM-Omni 0.30.0 reads the connectors of a deployment in two steps, which this module
repeats on the file's dict without importing vLLM-Omni (whose config package needs
vLLM, transformers and OmegaConf):

1. ``vllm_omni.config.stage_config.resolve_deploy_yaml``: the YAML, with ``base_config:``
   inheritance (the base file is read relative to the overlay's folder; ``connectors``
   are deep-merged, ``stages`` merged by ``stage_id`` with the overlay's fields winning,
   other top-level keys taken from the overlay);
2. ``vllm_omni.distributed.omni_connectors.utils.initialization.
   load_omni_transfer_config``: the new schema (top-level ``connectors`` + ``stages``)
   or the legacy one (``runtime.connectors`` + ``stage_args``); each stage's
   ``input_connectors`` (``from_stage_<id>: name``, or an inline ``{name, extra}``)
   and ``output_connectors`` (``to_stage_<id>: ...``) give an edge its connector, the
   first definition of an edge winning; an edge known only from ``runtime.edges`` /
   ``edges`` or a stage's ``engine_input_source`` gets vLLM-Omni's default
   ``SharedMemoryConnector``.

What the loader would refuse (an undefined connector reference, two connector types on
one edge, a connector without ``name``) is a problem here too; so is what it accepts in
silence but cannot be meant (an omnilink connector no stage refers to, an input key that
is not ``from_stage_<id>``, a key of a connector definition it ignores). Each
``OmnilinkConnector`` edge's ``extra`` goes through ``config.check_extra``, the check
the connector itself runs at construction. Unless ``host=False``, each omnilink edge is
also checked against this machine: the backend loads and can be used here (CUDA for
``cuda_ipc``, NCCL for ``nccl``), the ``device`` exists, the ``shm`` arenas fit the
free space of ``/dev/shm``, and vLLM-Omni would load omnilink's plugin under the
current ``VLLM_PLUGINS``.

Exit status of ``omnilink check``: 0 no problem, 1 problems found, 2 bad usage or a file
that cannot be read or parsed.
"""

from __future__ import annotations

import copy
import difflib
import json
import os
import re
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from omnilink._errors import ConfigurationError
from omnilink.integrations.vllm_omni.config import CONNECTOR_NAME, check_extra

__all__ = ["CheckUsageError", "EdgeReport", "FileReport", "check_config", "check_file", "load_deploy_file"]

#: The connectors vLLM-Omni 0.30.0's ``OmniConnectorFactory`` registers itself.
VLLM_OMNI_CONNECTORS = (
    "MooncakeConnector", "MooncakeStoreConnector", "MooncakeTransferEngineConnector",
    "MoriTransferEngineConnector", "NixlConnector", "SharedMemoryConnector", "YuanrongConnector",
    "YuanrongTransferEngineConnector",
)
DEFAULT_CONNECTOR = "SharedMemoryConnector"
#: Keys of a connector definition that vLLM-Omni reads; any other is ignored by it.
_DEFINITION_KEYS = ("name", "extra")
_INPUT_KEY = re.compile(r"from_stage_(.+)")
_OUTPUT_KEY = re.compile(r"to_stage_(.+)")
_MAX_BASE_DEPTH = 16


class CheckUsageError(Exception):
    """A file that cannot be read or parsed (``omnilink check`` exits with 2)."""


@dataclass
class EdgeReport:
    """One stage edge and the connector vLLM-Omni would give it."""

    from_stage: str
    to_stage: str
    connector: str
    source: str
    definition: str | None = None
    backend: str | None = None
    problems: list[str] = field(default_factory=list)
    here: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)


@dataclass
class FileReport:
    """What ``check_file`` found in one deployment file."""

    path: str
    edges: list[EdgeReport] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)
    here: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)

    @property
    def problem_count(self) -> int:
        return len(self.problems) + len(self.here) + sum(len(e.problems) + len(e.here) for e in self.edges)

    def as_dict(self) -> dict[str, Any]:
        return {"path": self.path, "problems": self.problems, "here": self.here, "notes": self.notes,
                "edges": [asdict(e) for e in self.edges], "problem_count": self.problem_count}


# ------------------------------------------------------------------------ reading
def _read(path: Path) -> Any:
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as exc:
        raise CheckUsageError(f"{path}: cannot read: {exc.strerror or exc}") from exc
    except UnicodeDecodeError as exc:
        raise CheckUsageError(f"{path}: not UTF-8 text: {exc}") from exc
    suffix = path.suffix.lower()
    if suffix == ".json":
        try:
            return json.loads(text)
        except json.JSONDecodeError as exc:
            raise CheckUsageError(f"{path}: invalid JSON: {exc}") from exc
    if suffix not in (".yaml", ".yml"):
        raise CheckUsageError(f"{path}: unsupported file type {path.suffix!r}; vLLM-Omni reads .yaml, .yml and .json")
    try:
        import yaml  # type: ignore[import-untyped, unused-ignore]  # no stubs needed at run time
    except ImportError as exc:
        raise CheckUsageError(f"reading YAML needs PyYAML: pip install pyyaml ({exc})") from exc
    try:
        return yaml.safe_load(text)
    except yaml.YAMLError as exc:
        raise CheckUsageError(f"{path}: invalid YAML: {exc}") from exc


def _merge(base: Any, overlay: Any) -> Any:
    if isinstance(base, dict) and isinstance(overlay, dict):
        out = dict(base)
        for k, v in overlay.items():
            out[k] = _merge(out.get(k), v)
        return out
    return overlay


def _merge_stages(base: Any, overlay: Any) -> list[Any]:
    by_id: dict[Any, Any] = {}
    order: list[Any] = []
    for stage in list(base or []) + list(overlay or []):
        if not isinstance(stage, dict) or "stage_id" not in stage:
            raise CheckUsageError(f"every entry of stages must be a mapping with a stage_id, got {stage!r}")
        sid = stage["stage_id"]
        if sid in by_id:
            # Overlay fields win; vLLM-Omni deep-merges only sampling and engine
            # parameters, none of which names a connector.
            by_id[sid] = {**by_id[sid], **stage}
        else:
            by_id[sid] = stage
            order.append(sid)
    return [by_id[sid] for sid in order]


def load_deploy_file(path: str | os.PathLike[str], _depth: int = 0) -> dict[str, Any]:
    """Read a deployment file as vLLM-Omni 0.30.0 does, ``base_config`` resolved.

    Raises
    ------
    CheckUsageError
        The file (or a base it names) cannot be read, is not YAML / JSON, is not a
        mapping, or the ``base_config`` chain loops.
    """
    p = Path(path)
    if _depth > _MAX_BASE_DEPTH:
        raise CheckUsageError(f"{p}: base_config chain deeper than {_MAX_BASE_DEPTH} files (a loop?)")
    raw = _read(p)
    if raw is None:
        raw = {}
    if not isinstance(raw, dict):
        raise CheckUsageError(f"{p}: a deployment file is a mapping at the top, got {type(raw).__name__}")
    raw = dict(raw)
    base_name = raw.pop("base_config", None)
    if base_name is None:
        return raw
    if not isinstance(base_name, str):
        raise CheckUsageError(f"{p}: base_config must be a file name, got {base_name!r}")
    base = load_deploy_file(p.parent / base_name, _depth + 1)
    merged = {**base, **{k: v for k, v in raw.items() if k not in ("connectors", "stages", "platforms")}}
    if base.get("connectors") or raw.get("connectors"):
        merged["connectors"] = _merge(base.get("connectors") or {}, raw.get("connectors") or {})
    merged["stages"] = _merge_stages(base.get("stages"), raw.get("stages"))
    if base.get("platforms") or raw.get("platforms"):
        merged["platforms"] = _merge(base.get("platforms") or {}, raw.get("platforms") or {})
    return merged


# -------------------------------------------------------------------------- edges
def _normalise(config: dict[str, Any]) -> dict[str, Any]:
    """The legacy shape ``load_omni_transfer_config`` parses (``runtime`` + ``stage_args``)."""
    if "stages" in config and "stage_args" not in config:
        out = dict(config)
        runtime = dict(out.get("runtime") or {})
        if "connectors" in out and "connectors" not in runtime:
            runtime["connectors"] = out["connectors"]
        if "edges" in out and "edges" not in runtime:
            runtime["edges"] = out["edges"]
        out["runtime"] = runtime
        out["stage_args"] = out["stages"]
        return out
    return config


def _close(word: str, choices: list[str]) -> str:
    match = difflib.get_close_matches(word, choices, n=1, cutoff=0.6)
    return f" (did you mean {match[0]!r}?)" if match else ""


def _resolve(
    config: dict[str, Any], report: FileReport
) -> tuple[dict[tuple[str, str], EdgeReport], dict[tuple[str, str], Any]]:
    """The edges and their connectors, as ``load_omni_transfer_config`` makes them, and
    each defined edge's ``extra``; what the loader would raise for, or what cannot be
    meant, goes to ``report.problems``."""
    config = _normalise(config)
    runtime = config.get("runtime") or {}
    if not isinstance(runtime, dict):
        report.problems.append(f"runtime must be a mapping, got {runtime!r}")
        runtime = {}
    defined = runtime.get("connectors") or {}
    if not isinstance(defined, dict):
        report.problems.append(f"connectors must be a mapping of name -> {{name, extra}}, got {defined!r}")
        defined = {}
    stages = config.get("stage_args") or []
    if not isinstance(stages, list):
        report.problems.append(f"stages must be a list, got {type(stages).__name__}")
        stages = []
    for ref, definition in defined.items():
        if not isinstance(definition, dict) or "name" not in definition:
            report.problems.append(f"connector {ref!r} has no name: vLLM-Omni fails with KeyError 'name'")
            continue
        for key in definition:
            if key not in _DEFINITION_KEYS:
                report.problems.append(
                    f"connector {ref!r}: key {key!r} is ignored by vLLM-Omni{_close(str(key), list(_DEFINITION_KEYS))}"
                )
    stage_ids = [str(s["stage_id"]) for s in stages if isinstance(s, dict) and "stage_id" in s]
    edges: dict[tuple[str, str], EdgeReport] = {}
    extras: dict[tuple[str, str], Any] = {}
    used: set[str] = set()

    def spec(ref: Any, where: str) -> tuple[str, dict[str, Any], str | None] | None:
        if isinstance(ref, str):
            definition = defined.get(ref)
            if not isinstance(definition, dict) or "name" not in definition:
                if ref not in defined:
                    report.problems.append(
                        f"{where}: undefined connector reference {ref!r}{_close(ref, list(defined))}: "
                        "vLLM-Omni refuses the file"
                    )
                return None
            used.add(ref)
            extra = definition.get("extra") or {}
            return str(definition["name"]), extra, ref
        if isinstance(ref, dict) and "name" in ref:
            return str(ref["name"]), ref.get("extra") or {}, None
        report.problems.append(f"{where}: a connector is a name under connectors or a mapping with name, got {ref!r}")
        return None

    for stage in stages:
        if not isinstance(stage, dict) or "stage_id" not in stage:
            report.problems.append(f"a stage without stage_id: {stage!r}")
            continue
        sid = str(stage["stage_id"])
        for attr, pattern, incoming in (("input_connectors", _INPUT_KEY, True), ("output_connectors", _OUTPUT_KEY, False)):
            conns = stage.get(attr) or {}
            if not isinstance(conns, dict):
                report.problems.append(f"stage {sid}: {attr} must be a mapping, got {conns!r}")
                continue
            for key, ref in conns.items():
                where = f"stage {sid} {attr}.{key}"
                m = pattern.fullmatch(str(key))
                if m is None:
                    want = "from_stage_<id>" if incoming else "to_stage_<id>"
                    report.problems.append(f"{where}: the key must be {want}; vLLM-Omni would make a stage named {key!r}")
                    continue
                other = m.group(1)
                if other not in stage_ids:
                    report.problems.append(f"{where}: stage {other} is not one of the file's stages ({', '.join(stage_ids)})")
                got = spec(ref, where)
                if got is None:
                    continue
                name, extra, ref_name = got
                edge = (other, sid) if incoming else (sid, other)
                if edge in edges:
                    if edges[edge].connector != name:
                        report.problems.append(
                            f"{where}: edge {edge[0]} -> {edge[1]} is already {edges[edge].connector!r} "
                            f"({edges[edge].source}); vLLM-Omni refuses two connector types on one edge"
                        )
                    continue
                edges[edge] = EdgeReport(edge[0], edge[1], name, where, definition=ref_name)
                extras[edge] = extra
    # Edges the pipeline names without a connector: vLLM-Omni's default.
    implied: list[tuple[tuple[str, str], str]] = []
    runtime_edges = runtime.get("edges") or []
    if isinstance(runtime_edges, list):
        for e in runtime_edges:
            if isinstance(e, dict) and e.get("from") is not None and e.get("to") is not None:
                implied.append(((str(e["from"]), str(e["to"])), "edges"))
    for stage in stages:
        if isinstance(stage, dict) and "stage_id" in stage:
            for src in stage.get("engine_input_source") or []:
                implied.append(((str(src), str(stage["stage_id"])), f"stage {stage['stage_id']} engine_input_source"))
    for edge, where in implied:
        if edge not in edges:
            edges[edge] = EdgeReport(edge[0], edge[1], DEFAULT_CONNECTOR, f"{where} (vLLM-Omni's default)")
    for ref, definition in defined.items():
        if ref not in used and isinstance(definition, dict) and definition.get("name") == CONNECTOR_NAME:
            report.problems.append(
                f"connector {ref!r} ({CONNECTOR_NAME}) is defined but no stage names it in input_connectors or "
                "output_connectors: vLLM-Omni gives those edges SharedMemoryConnector"
            )
    return edges, extras


# -------------------------------------------------------------------- this host
def _host(edge: EdgeReport, settings: Any, shm_arenas: list[tuple[EdgeReport, int | None]]) -> None:
    """What keeps ``edge``'s omnilink backend from running on this machine."""
    from omnilink.connectors import backend_unavailable

    why = backend_unavailable(settings.backend)
    if why is not None:
        edge.here.append(f"backend {settings.backend!r} cannot run here: {why}")
        return
    if settings.device is not None:
        from omnilink.integrations.vllm_omni.config import _check_device

        try:
            _check_device(settings.device)
        except ConfigurationError as exc:
            edge.here.append(str(exc).replace("OmnilinkConnector: ", ""))
    if settings.backend == "shm":
        arena = settings.options.get("arena_bytes")
        shm_arenas.append((edge, arena if isinstance(arena, int) else None))
    elif settings.backend == "nixl":
        endpoint = settings.options.get("endpoint")
        if not (isinstance(endpoint, str) and endpoint.startswith("tcp://")):
            edge.notes.append("nixl without options.endpoint tcp://HOST:PORT: the control channel is an ipc "
                              "socket, so both stages must run on this host")
    elif settings.backend == "nccl":
        import torch

        wants = settings.options.get("backend", "auto")
        if not torch.distributed.is_available():
            edge.here.append("torch.distributed is not available here: the nccl backend cannot run")
        elif wants == "nccl" and not (torch.distributed.is_nccl_available() and torch.cuda.is_available()):
            edge.here.append("options.backend is 'nccl' but NCCL with a CUDA device is not available here")
        elif wants == "auto" and not (torch.distributed.is_nccl_available() and torch.cuda.is_available()):
            edge.notes.append("here: no NCCL with CUDA, so the nccl backend would run over gloo on CPU")
        elif wants != "gloo":
            from omnilink.cuda import CUDA_INSTALL_HINT, have_cuda_ops

            if not have_cuda_ops():
                edge.here.append(f"the nccl backend on GPUs needs cuda-python, which is not importable here: "
                                 f"{CUDA_INSTALL_HINT}")
            from omnilink._errors import CudaError
            from omnilink.cuda import nccl_library

            try:
                nccl_library()
            except CudaError as exc:
                edge.here.append(f"the nccl backend on GPUs calls NCCL's library, which does not load here: {exc}")


def _check_shm_space(shm_arenas: list[tuple[EdgeReport, int | None]]) -> None:
    """Explicit arenas must fit ``/dev/shm`` here, alone and together (the stages of one
    file usually share a host); automatic ones are sized to fit."""
    if not shm_arenas:
        return
    from omnilink.connectors.shm import DEFAULT_ARENA_BYTES, SHM_DIR

    try:
        st = os.statvfs(SHM_DIR)
    except OSError as exc:
        for edge, _ in shm_arenas:
            edge.here.append(f"{SHM_DIR} is not usable here ({exc}): the shm backend needs it")
        return
    free = st.f_bavail * st.f_frsize
    mib = 1 << 20
    total = 0
    for edge, arena in shm_arenas:
        if arena is None:
            start = max(mib, min(DEFAULT_ARENA_BYTES, (free // 4) >> 20 << 20))
            edge.notes.append(f"here: the sender's arena starts at {start // mib} MiB "
                              f"({SHM_DIR}: {free / mib:.0f} MiB free)")
            continue
        total += arena
        if arena <= free:
            edge.notes.append(f"here: the sender's arena of {arena // mib} MiB fits {SHM_DIR} "
                              f"({free / mib:.0f} MiB free)")
        else:
            edge.here.append(
                f"options.arena_bytes is {arena / mib:.0f} MiB but {SHM_DIR} has {free / mib:.0f} MiB free here: "
                "the sending stage fails at start. Give it room (docker run --shm-size, or --ipc=host; "
                "Kubernetes: a memory-backed emptyDir on /dev/shm) or drop arena_bytes to size the arena to fit"
            )
    fixed = [e for e, a in shm_arenas if a is not None]
    if len(fixed) > 1 and total > free and all(not e.here for e in fixed):
        fixed[-1].here.append(
            f"the arenas of the {len(fixed)} shm edges need {total / mib:.0f} MiB together but {SHM_DIR} has "
            f"{free / mib:.0f} MiB free here (stages on one host share it)"
        )


# ------------------------------------------------------------------------ checks
def check_config(config: dict[str, Any], *, path: str = "<config>", host: bool = True) -> FileReport:
    """Check a deployment dict (``base_config`` already resolved).

    Parameters
    ----------
    config : dict
        The deployment, either schema.
    path : str
        Its name in the report.
    host : bool
        Also check each omnilink edge against this machine (backend, device, shm size).

    Returns
    -------
    FileReport
        The edges sorted by (from, to) stage, each with the connector it resolves to.
    """
    report = FileReport(path=path)
    edges, extras = _resolve(copy.deepcopy(config), report)
    shm_arenas: list[tuple[EdgeReport, int | None]] = []
    for key in sorted(edges, key=lambda e: (_sort_key(e[0]), _sort_key(e[1]))):
        edge = edges[key]
        report.edges.append(edge)
        extra = extras.get(key)
        if edge.connector != CONNECTOR_NAME:
            if edge.connector not in VLLM_OMNI_CONNECTORS:
                hint = _close(edge.connector, [CONNECTOR_NAME, *VLLM_OMNI_CONNECTORS])
                if hint:
                    edge.problems.append(f"unknown connector {edge.connector!r}{hint}")
                else:
                    edge.notes.append(f"{edge.connector!r} is neither omnilink's nor one of vLLM-Omni 0.30.0's "
                                      "connectors: another plugin must register it")
            continue
        if not isinstance(extra, dict):
            edge.problems.append(f"extra must be a mapping, got {extra!r}")
            continue
        # What vLLM-Omni injects at start-up, so the check sees what the connector will.
        full = {"stage_id": int(edge.to_stage) if edge.to_stage.isdigit() else edge.to_stage, **extra}
        edge.backend = str(extra.get("backend", "shm"))
        try:
            settings = check_extra(full, probe=False)
        except ConfigurationError as exc:
            edge.problems.append(str(exc).replace("OmnilinkConnector: ", ""))
            continue
        if host:
            _host(edge, settings, shm_arenas)
    if host:
        _check_shm_space(shm_arenas)
        if any(e.connector == CONNECTOR_NAME for e in report.edges):
            from omnilink.integrations.vllm_omni.config import plugin_status

            plugin = plugin_status()
            if not plugin["loads"]:
                report.here.append(f"vLLM-Omni would not load omnilink's plugin here: {plugin['reason']}")
    return report


def _sort_key(stage: str) -> tuple[int, int | str]:
    return (0, int(stage)) if stage.isdigit() else (1, stage)


def check_file(path: str | os.PathLike[str], *, host: bool = True) -> FileReport:
    """Read and check one deployment file (see ``check_config``).

    Raises
    ------
    CheckUsageError
        The file cannot be read or parsed.
    """
    config = load_deploy_file(path)
    return check_config(config, path=str(path), host=host)


def format_report(report: FileReport) -> str:
    """``report`` as ``omnilink check`` prints it."""
    lines = [f"{report.path}:"]
    if not report.edges:
        lines.append("  no stage edges (no input_connectors, output_connectors, edges or engine_input_source)")
    for e in report.edges:
        what = e.connector
        if e.definition:
            what += f" {e.definition!r}"
        if e.backend:
            what += f", backend {e.backend}"
        lines.append(f"  edge {e.from_stage} -> {e.to_stage}: {what}  [{e.source}]")
        if e.connector == CONNECTOR_NAME and not e.problems:
            lines.append("    ok: extra and options validate")
        for p in e.problems:
            lines.append(f"    problem: {p}")
        for p in e.here:
            lines.append(f"    problem here: {p}")
        for n in e.notes:
            lines.append(f"    note: {n}")
    for p in report.problems:
        lines.append(f"  problem: {p}")
    for p in report.here:
        lines.append(f"  problem here: {p}")
    for n in report.notes:
        lines.append(f"  note: {n}")
    count = report.problem_count
    lines.append(f"  {count} problem{'s' if count != 1 else ''}" if count else "  ok")
    return "\n".join(lines)
