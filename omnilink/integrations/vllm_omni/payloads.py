"""How vLLM-Omni's payload objects become tensor_blob trees, and owned copies of received ones."""

from __future__ import annotations

import dataclasses
from typing import Any

_PLAIN = frozenset({int, float, str, bytes, bool, type(None)})


def _to_wire(obj: Any) -> Any:
    """``obj`` with every msgspec Struct and dataclass instance turned into a dict.

    vLLM-Omni's chunk adapter puts ``OmniPayloadStruct`` objects; its msgpack serializer
    turns them into dicts of their fields (omitting fields at their default when the
    struct has ``omit_defaults``) and the receiver reads dicts (``payload["meta"]``). The
    same conversion here keeps that contract; everything else is left to tensor_blob,
    which refuses (``BlobEncodeError``) what it cannot carry.
    """
    t = type(obj)
    if t in _PLAIN:
        return obj
    if isinstance(obj, dict):
        conv = {k: _to_wire(v) for k, v in obj.items()}
        return obj if all(conv[k] is v for k, v in obj.items()) else conv
    if isinstance(obj, (list, tuple)):
        if all(type(v) in _PLAIN for v in obj):  # token id lists: nothing to convert
            return obj
        items = [_to_wire(v) for v in obj]
        if all(a is b for a, b in zip(items, obj)):
            return obj
        return items if isinstance(obj, list) else tuple(items)
    import msgspec  # a dependency of omnilink, imported here to keep this path cheap

    if isinstance(obj, msgspec.Struct):
        omit = type(obj).__struct_config__.omit_defaults
        out: dict[str, Any] = {}
        for f in msgspec.structs.fields(obj):
            value = getattr(obj, f.name)
            if omit and _is_default(value, f):
                continue
            out[f.encode_name] = _to_wire(value)
        return out
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        # Not dataclasses.asdict: it deep-copies every tensor.
        return {f.name: _to_wire(getattr(obj, f.name)) for f in dataclasses.fields(obj)}
    return obj


def _is_default(value: Any, field: Any) -> bool:
    import msgspec

    if field.default is not msgspec.NODEFAULT:
        default = field.default
    elif field.default_factory is not msgspec.NODEFAULT:
        default = field.default_factory()
    else:
        return False
    if value is default:
        return True
    # Only plain values compare by ==; a tensor's == is elementwise.
    if type(value) is type(default) and isinstance(value, (int, float, str, bytes, list, dict, tuple)):
        try:
            return bool(value == default)
        except Exception:  # pragma: no cover - containers of tensors
            return False
    return False


def _owned(obj: Any) -> Any:
    """A copy of a received payload that owns its memory (no view of the transport)."""
    if isinstance(obj, dict):
        return {k: _owned(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_owned(v) for v in obj]
    if isinstance(obj, tuple):
        return tuple(_owned(v) for v in obj)
    clone = getattr(obj, "clone", None)
    if clone is not None and type(obj).__module__.startswith("torch"):
        return clone()
    if type(obj).__module__ == "numpy" and hasattr(obj, "copy") and hasattr(obj, "dtype"):
        return obj.copy()
    return obj
