"""Send plans: a stream of same-shaped payloads sent without walking each one again.

A stage sends the same structure every step (a vLLM-Omni chunk is a bf16 hidden state,
CPU token ids, a CPU ``finished`` flag and a few scalars), and the device pool's general
``send`` asks the same questions of each: walk the payload, pick each tensor's road,
check its dtype, lay the block out, build the manifest, walk the host part again for
the lane. A ``SendPlan`` is what those answers were for one payload, compiled into one
straight-line Python function (``match``) that checks a new payload against them and
picks its tensors, plus the manifest's tensor list already encoded. ``match`` returns
``None`` at the first difference (another key, another type, dtype, shape or device, a
tensor that is not plain: not contiguous, a negative or conjugate bit, a layout other
than strided), and the general ``send`` takes that payload, so a plan never changes what
is sent, only how fast.

What a plan covers: a ``dict`` payload of ``str`` keys whose values are tensors, plain
scalars (``str``, ``int``, ``float``, ``bool``, ``None``) and dicts of the same, every
tensor in the block (device tensors first, then small host tensors), at least one device
tensor, all of them on one device (the pool's, or one other GPU: then the copies are peer
copies); with ``keep_host``, small host tensors may also stay in the host part (at most
``MAX_KEPT_BYTES`` together; the lane carries them). Anything else (lists, tuples, bytes,
another host tensor left in the host part) is sent the general way every time.
"""

from __future__ import annotations

from typing import Any

import msgspec

from omnilink._treecode import TreeSource, Unmatchable, tuple_expr
from omnilink.blob import _frame_bytes, prepare

__all__ = ["SendPlan", "compile_plan"]

#: Most tensors and nodes a plan is compiled for (a larger payload goes the general way).
MAX_PLAN_TENSORS = 64
MAX_PLAN_NODES = 256
#: Most bytes of host tensors a plan keeps in the host part (``keep_host``): the lane
#: record holds them, its manifest and the rest of the host part.
MAX_KEPT_BYTES = 1024


class SendPlan:
    """A compiled plan (see the module docstring).

    ``match(payload)`` -> ``(host part, device tensors, host tensors)`` in the manifest's
    order, or ``None``; ``entries`` the manifest's tensor list (``raw``: its msgpack),
    ``dev_items`` ``[(offset in block, nbytes)]`` of the device tensors, ``host_items``
    the same of the host tensors (after the device ones), ``host_first``/``host_span``
    where they start in the block and how many bytes they span, ``total`` the block's
    bytes."""

    __slots__ = ("match", "entries", "raw", "dev_items", "host_items", "host_first", "host_span", "total",
                 "size_base", "data_len", "device", "kept")

    def __init__(self, match: Any, entries: list[list[Any]], dev_items: list[tuple[int, int]],
                 host_items: list[tuple[int, int]], total: int, device: int = 0) -> None:
        #: the device index its device tensors live on (the pool's, or one other GPU's)
        self.device = device
        #: host tensors its payloads keep in the host part (``keep_host``)
        self.kept = 0
        #: ``size(host_bytes)``'s constants (``size_base`` ``None``: the plan cannot
        #: size its payloads; ``calibrate``)
        self.size_base: int | None = None
        self.data_len = 0
        self.match = match
        self.entries = entries
        self.raw = msgspec.Raw(msgspec.msgpack.encode(entries))
        self.dev_items = dev_items
        self.host_items = host_items
        self.host_first = host_items[0][0] if host_items else 0
        self.host_span = (host_items[-1][0] + host_items[-1][1] - self.host_first) if host_items else 0
        self.total = total


    def calibrate(self, payload: Any, host: Any, encode: Any = None) -> None:
        """Learn how the tensor_blob size of this plan's payloads follows from their host
        part's msgpack (``size``), from ``payload`` (``host``: its host part): a payload
        of the plan has the same tensor descriptors and tree, but for its scalars, which
        msgpack encodes alike in the host part and in the tensor_blob header; every
        tensor is a 1-byte ``None`` in the one and a 6-byte reference in the other. Kept
        only if it gives ``payload``'s own size back. ``encode``: how the host part is
        encoded (``lane.encode_host`` for a plan that keeps host tensors there: each a
        fixed-length extension for its dtype and shape)."""
        blob = prepare(payload)
        h = len((encode or msgspec.msgpack.encode)(host))
        self.size_base, self.data_len = blob.header_len - h, blob.data_len
        if self.size(h) != blob.nbytes:  # pragma: no cover - the format changed under the plan
            self.size_base = None

    def size(self, host_bytes: int) -> int:
        """The tensor_blob size of a payload of this plan whose host part's msgpack is
        ``host_bytes`` long (``calibrate``)."""
        return _frame_bytes(self.size_base + host_bytes, self.data_len)


def compile_plan(payload: Any, entries: list[list[Any]], chosen: list[tuple[Any, Any, int]], total: int,
                 device: int, checks: tuple[str, str], keep_host: bool = False) -> SendPlan | None:
    """The plan of ``payload`` as the general ``send`` laid it out: ``entries`` its
    manifest's tensor list, ``chosen`` the ``[(path, tensor, pick)]`` its walk picked
    (``pick`` 2: a small host tensor), ``total`` its block's bytes, ``device`` the pool's
    device index, ``checks`` the device operations' tests (``plan_checks``) that a tensor
    ``{v}`` is not a device tensor of ``{device}``, and not a host tensor for the block.
    ``device``: where the payload's device tensors live (the pool's device, or the one
    other GPU they all live on); the plan's payloads must have theirs there too.
    ``keep_host``: small host tensors outside ``chosen`` stay in the host part (each
    pinned to its dtype and shape; ``SendPlan.kept`` counts them). ``None`` when the
    payload is not of the kind a plan covers."""
    import torch

    if type(payload) is not dict or not chosen or len(chosen) > MAX_PLAN_TENSORS:
        return None
    if len(chosen) != len(entries):
        return None
    # The manifest's order: device tensors in walk order, then host tensors.
    order = {tuple(e[4]): i for i, e in enumerate(entries)}
    tensors = {tuple(path): t for path, t, _pick in chosen}
    if len(order) != len(entries) or set(order) != set(tensors) or all(p == 2 for *_, p in chosen):
        return None
    dev_check, host_check = checks
    dt_names: dict[Any, str] = {}
    src = TreeSource({"_T": torch.Tensor, "_S": torch.strided}, MAX_PLAN_NODES)
    const = src.const
    tvars: dict[int, str] = {}
    kept = [0, 0]  # host tensors kept in the host part, their bytes

    def entry(v: Any, c: str, p: tuple[Any, ...]) -> str | None:
        if p in order:
            if type(v) is not torch.Tensor:
                raise Unmatchable
            tvars[order[p]] = c
            src.line(f"if type({c}) is not _T: return None")
            return "None"
        if keep_host and type(v) is torch.Tensor and v.is_cpu and v.layout is torch.strided:
            # A small host tensor the host part keeps (the lane encodes it).
            kept[0] += 1
            kept[1] += v.numel() * v.element_size()
            if kept[1] > MAX_KEPT_BYTES:
                raise Unmatchable
            src.line(f"if type({c}) is not _T or not {c}.is_cpu or {c}.layout is not _S "
                     f"or {c}.dtype is not {const(v.dtype)} or {c}.shape != {const(v.shape)}: return None")
            return c
        return None  # a dict or a leaf; anything else (a host tensor left in the host part, a list): unplannable

    try:
        host_expr = src.node(payload, "p", (), entry)
    except Unmatchable:
        return None
    if len(tvars) != len(entries):
        return None
    dev_vars, host_vars = [], []
    dev_items: list[tuple[int, int]] = []
    host_items: list[tuple[int, int]] = []
    for i, e in enumerate(entries):
        off, nbytes, shape = e[1], e[2], e[3]
        c = tvars[i]
        dt = tensors[tuple(e[4])].dtype
        dn = dt_names.get(dt)
        if dn is None:
            dn = dt_names[dt] = const(dt)
        sh = const(torch.Size(shape))
        conj = f" or {c}.is_conj()" if dt.is_complex else ""
        if len(e) == 6:  # a small host tensor carried in the block
            src.line(f"if {host_check.format(v=c)} or {c}.dtype is not {dn} or {c}.shape != {sh} "
                     f"or not {c}.is_contiguous() or {c}.is_neg(){conj}: return None")
            host_vars.append(c)
            host_items.append((off, nbytes))
        else:
            src.line(f"if {dev_check.format(v=c, device=device)} or {c}.dtype is not {dn} "
                     f"or {c}.shape != {sh} or not {c}.is_contiguous() or {c}.is_neg(){conj}: return None")
            dev_vars.append(c)
            dev_items.append((off, nbytes))
    src.line(f"return {host_expr}, {tuple_expr(dev_vars)}, {tuple_expr(host_vars)}")
    plan = SendPlan(src.compile("<omnilink send plan>"), entries, dev_items, host_items, total, device)
    plan.kept = kept[0]
    return plan
