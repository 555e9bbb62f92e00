"""Self-test of ``omnilink.testing``: the suite must catch broken connectors, report
clearly, clean up after itself, and its payload comparison must be bit-exact."""

from __future__ import annotations

import copy
import math
import threading

import numpy as np
import pytest
import torch

import omnilink
from omnilink.connectors import BaseConnector, memory
from omnilink.connectors.memory import MemoryConnector
from omnilink.testing import CHECKS, ConformanceError, assert_payload_equal, check_connector, payload_zoo

EXPECTED_CHECKS = [
    "protocol",
    "round_trip_zoo",
    "empty_payloads",
    "put_copies_payload",
    "exactly_once",
    "key_contract",
    "out_of_order",
    "many_in_flight",
    "get_timeout",
    "get_nowait",
    "blocking_get_woken",
    "put_async",
    "batch",
    "discard",
    "key_rules",
    "bad_timeouts",
    "unsupported_payload",
    "channel_isolation",
    "views_stay_valid",
    "get_device_cpu",
    "stats",
    "context_manager",
    "use_after_close",
    "huge_payload",
]


class Tracker:
    """A pair factory over a connector class that remembers everything it opened."""

    def __init__(self, cls=MemoryConnector, **options):
        self.cls = cls
        self.options = options
        self.opened: list[MemoryConnector] = []

    def __call__(self, channel):
        tx = self.cls(channel=channel, role="sender", **self.options)
        rx = self.cls(channel=channel, role="receiver", **self.options)
        self.opened += [tx, rx]
        return tx, rx

    def all_closed(self) -> bool:
        return all(c._closed for c in self.opened)


def suite_channels() -> list[str]:
    return [name for name in memory._channels if name.startswith("olconf/")]


def run_broken(cls, check, **kwargs) -> ConformanceError:
    factory = Tracker(cls)
    with pytest.raises(ConformanceError) as info:
        check_connector(factory, only=[check], huge_bytes=1 << 20, **kwargs)
    assert factory.opened and factory.all_closed(), "the suite left a connector open"
    assert not suite_channels()
    err = info.value
    assert isinstance(err, AssertionError)
    assert f"'{check}'" in str(err)
    assert list(err.failures) == [check]
    return err


# ------------------------------------------------------------------ broken backends


class DeliversTwice(MemoryConnector):
    """Puts every payload it hands out back on the channel."""

    def _get(self, key, deadline, block):
        obj = super()._get(key, deadline, block)
        with self._chan.cond:
            self._chan.frames[key] = bytearray(omnilink.encode(obj))
        return obj


def _lists(obj):
    if isinstance(obj, dict):
        return {k: _lists(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_lists(v) for v in obj]
    return obj


class TuplesBecomeLists(MemoryConnector):
    def _get(self, key, deadline, block):
        return _lists(super()._get(key, deadline, block))


class Bf16BecomesFloat16(MemoryConnector):
    def _get(self, key, deadline, block):
        def fix(o):
            if isinstance(o, torch.Tensor) and o.dtype == torch.bfloat16:
                return o.to(torch.float16)
            if isinstance(o, dict):
                return {k: fix(v) for k, v in o.items()}
            return o

        return fix(super()._get(key, deadline, block))


class LosesNegativeZero(MemoryConnector):
    def _get(self, key, deadline, block):
        def fix(o):
            if isinstance(o, float) and o == 0.0:
                return 0.0
            if isinstance(o, dict):
                return {k: fix(v) for k, v in o.items()}
            return o

        return fix(super()._get(key, deadline, block))


class BareTimeout(MemoryConnector):
    """Raises a TransferTimeout that does not say what timed out."""

    def _get(self, key, deadline, block):
        try:
            return super()._get(key, deadline, block)
        except omnilink.TransferTimeout:
            raise omnilink.TransferTimeout("timed out") from None


class TimeoutIsWouldBlock(MemoryConnector):
    def _get(self, key, deadline, block):
        try:
            return super()._get(key, deadline, block)
        except omnilink.TransferTimeout as exc:
            raise omnilink.WouldBlock(str(exc)) from None


class NowaitReturnsNone(MemoryConnector):
    """The vLLM-style "None means not there yet" instead of WouldBlock."""

    def get_nowait(self, key, /, *, device=None):
        try:
            return super().get_nowait(key, device=device)
        except omnilink.WouldBlock:
            return None


class NeverCloses(MemoryConnector):
    def _check_open(self):
        pass

    def _raise_if_closing(self):
        pass


class AcceptsAnyKey(MemoryConnector):
    def put(self, key, payload, /, *, timeout=None):
        n = self._put(str(key), payload, self._deadline(timeout))
        self._count(puts=1, bytes_put=n)
        return n


class SwallowsEncodeErrors(MemoryConnector):
    def put(self, key, payload, /, *, timeout=None):
        try:
            return super().put(key, payload, timeout=timeout)
        except omnilink.BlobEncodeError:
            return 1


class KeepsCallerObjects(MemoryConnector):
    """Passes the caller's objects by reference instead of through the wire."""

    _store: dict = {}

    def _put(self, key, payload, deadline):
        n = super()._put(key, {}, deadline)
        self._store[(self.channel, key)] = payload
        return n

    def _get(self, key, deadline, block):
        super()._get(key, deadline, block)
        return self._store.pop((self.channel, key))


class ReusesOneBuffer(MemoryConnector):
    """Decodes every frame into the same scratch buffer: held views change later."""

    def _get(self, key, deadline, block):
        chan = self._chan
        with chan.cond:
            frame = chan.frames.get(key)
        obj = super()._get(key, deadline, block)
        if frame is None:
            return obj
        scratch = getattr(self, "_scratch", None)
        if scratch is None or len(scratch) < len(frame):
            scratch = self._scratch = bytearray(len(frame) * 2)
        scratch[: len(frame)] = frame
        return omnilink.decode(memoryview(scratch)[: len(frame)])


class ForgetsBytesGot(MemoryConnector):
    def _count(self, **deltas):
        deltas.pop("bytes_got", None)
        super()._count(**deltas)


class OverwritesPendingKey(MemoryConnector):
    """shm's old behaviour: a second put of a pending key is accepted silently."""

    def _check_key_free(self, key):
        pass


class ForgetsConsumedKeys(MemoryConnector):
    """A get of a consumed key waits for its timeout instead of saying it was consumed."""

    def _get(self, key, deadline, block):
        with self._chan.cond:
            self._chan.consumed.forget(key)
        return super()._get(key, deadline, block)


class BatchTakesWhatIsThere(MemoryConnector):
    """get_many as a loop of get: a timeout leaves the keys taken before it consumed."""

    def _get_many(self, keys, deadline, device):
        got = {}
        for k in keys:
            try:
                got[k] = self.get(k, timeout=deadline.remaining())
            except omnilink.TransferTimeout:
                raise self._many_timeout(keys, [k], None, deadline.timeout) from None
        return got


class BatchErrorHidesWhatWasSent(MemoryConnector):
    """put_many as a loop of put whose error does not say what went out."""

    def _put_many(self, keys, payloads, deadline):
        return [self.put(k, p, timeout=deadline.remaining()) for k, p in zip(keys, payloads)]


class BatchWithdrawsOnError(MemoryConnector):
    """put_many that takes back what it sent when a later item fails, but still says
    it was sent."""

    def _put_many(self, keys, payloads, deadline):
        try:
            return BaseConnector._put_many(self, keys, payloads, deadline)  # one put after the other
        except omnilink.BlobEncodeError as exc:
            for k in exc.sent:
                self._discard(k)
            raise


class BatchReversed(MemoryConnector):
    def _get_many(self, keys, deadline, device):
        got = super()._get_many(keys, deadline, device)
        return dict(reversed(got.items()))


class DiscardReturnsNone(MemoryConnector):
    def discard(self, key, /):
        super().discard(key)


@pytest.mark.parametrize(
    "cls, check, fragment",
    [
        (DeliversTwice, "exactly_once", "after the key was consumed"),
        (TuplesBecomeLists, "round_trip_zoo", "type list, expected tuple"),
        (Bf16BecomesFloat16, "round_trip_zoo", "dtype torch.float16, expected torch.bfloat16"),
        (LosesNegativeZero, "round_trip_zoo", "bit for bit"),
        (BareTimeout, "get_timeout", "must name channel"),
        (TimeoutIsWouldBlock, "get_timeout", "expected TransferTimeout, got WouldBlock"),
        (NowaitReturnsNone, "get_nowait", "expected WouldBlock, but it returned None"),
        (NeverCloses, "use_after_close", "expected ClosedError"),
        (NeverCloses, "context_manager", "expected ClosedError"),
        (AcceptsAnyKey, "key_rules", "expected ConfigurationError"),
        (SwallowsEncodeErrors, "unsupported_payload", "expected BlobEncodeError"),
        (KeepsCallerObjects, "put_copies_payload", "after put returned"),
        (ReusesOneBuffer, "views_stay_valid", "changed while later payloads passed"),
        (ForgetsBytesGot, "stats", "bytes_got moved by 0"),
        (DiscardReturnsNone, "discard", "must return False"),
        (OverwritesPendingKey, "key_contract", "expected DuplicateKeyError, but it returned"),
        (ForgetsConsumedKeys, "key_contract", "expected KeyConsumedError, got WouldBlock"),
        (ForgetsConsumedKeys, "exactly_once", "expected KeyConsumedError"),
        (BatchTakesWhatIsThere, "batch", "present during a timed-out get_many raised KeyConsumedError"),
        (BatchErrorHidesWhatWasSent, "batch", "must name what it sent"),
        (BatchWithdrawsOnError, "batch", "get_many of the keys put_many sent raised KeyConsumedError"),
        (BatchReversed, "batch", "in the order asked"),
    ],
)
def test_broken_connector_is_caught(cls, check, fragment):
    err = run_broken(cls, check)
    assert fragment in str(err), str(err)


def test_each_broken_connector_fails_only_where_expected():
    # The bugs above are specific: a connector that mangles bfloat16 still passes the
    # checks that never send one (the suite does not fail everything indiscriminately).
    factory = Tracker(Bf16BecomesFloat16)
    assert check_connector(factory, only=["exactly_once", "discard", "stats"]) == [
        "exactly_once",
        "discard",
        "stats",
    ]


# ------------------------------------------------------------------ check_connector


def test_checks_are_named_documented_and_stable():
    assert list(CHECKS) == EXPECTED_CHECKS
    for name, check in CHECKS.items():
        assert callable(check)
        assert check.__doc__ and check.__doc__.strip(), f"check {name!r} has no docstring"


def test_full_run_on_memory_passes_and_closes_everything():
    factory = Tracker()
    assert check_connector(factory, huge_bytes=1 << 20) == EXPECTED_CHECKS
    assert factory.all_closed()
    assert not suite_channels()


def test_a_check_runs_alone_from_CHECKS():
    factory = Tracker()
    CHECKS["exactly_once"](factory)
    assert factory.all_closed()
    with pytest.raises(ConformanceError, match="exactly_once"):
        CHECKS["exactly_once"](Tracker(DeliversTwice))


def test_only_and_skip_keep_the_stable_order():
    assert check_connector(Tracker(), only=["stats", "protocol"]) == ["protocol", "stats"]
    ran = check_connector(Tracker(), only=["stats", "protocol", "discard"], skip=["discard"])
    assert ran == ["protocol", "stats"]


@pytest.mark.parametrize(
    "kwargs, fragment",
    [
        ({"only": ["no_such_check"]}, "no_such_check"),
        ({"skip": ["nope"]}, "nope"),
        ({"only": "protocol"}, "not a str"),
        ({"huge_bytes": 0}, "huge_bytes"),
        ({"huge_bytes": True}, "huge_bytes"),
    ],
)
def test_bad_arguments_are_configuration_errors(kwargs, fragment):
    with pytest.raises(omnilink.ConfigurationError, match=fragment):
        check_connector(Tracker(), **kwargs)


def test_several_failures_are_all_reported():
    class Both(TuplesBecomeLists, NeverCloses):
        pass

    factory = Tracker(Both)
    with pytest.raises(ConformanceError) as info:
        check_connector(factory, only=["round_trip_zoo", "protocol", "use_after_close"])
    err = info.value
    assert set(err.failures) == {"round_trip_zoo", "use_after_close"}
    assert "2 of 3 conformance checks failed" in str(err)
    assert "round_trip_zoo" in str(err) and "use_after_close" in str(err)
    assert err.__cause__ is not None
    assert factory.all_closed()


def test_a_factory_that_raises_is_reported():
    def factory(channel):
        raise RuntimeError("no backend today")

    with pytest.raises(ConformanceError, match="pair factory raised RuntimeError.*no backend today"):
        check_connector(factory, only=["protocol"])


def test_a_factory_that_returns_the_wrong_shape_is_reported_and_cleaned_up():
    opened = []

    def factory(channel):
        conn = MemoryConnector(channel=channel)
        opened.append(conn)
        return [conn]

    with pytest.raises(ConformanceError, match=r"\(sender, receiver\) tuple"):
        check_connector(factory, only=["protocol"])
    assert opened and all(c._closed for c in opened)


def test_unexpected_exceptions_become_conformance_errors():
    class Explodes(MemoryConnector):
        def stats(self):
            raise KeyError("boom")

    with pytest.raises(ConformanceError, match="stats") as info:
        check_connector(Tracker(Explodes), only=["stats"])
    assert isinstance(info.value.__cause__, ConformanceError)
    assert isinstance(info.value.__cause__.__cause__, KeyError)


def test_a_failing_close_is_reported():
    class CloseFails(MemoryConnector):
        def close(self):
            super().close()
            raise RuntimeError("close broke")

    with pytest.raises(ConformanceError, match="close broke"):
        check_connector(Tracker(CloseFails), only=["protocol"])


def test_the_suite_leaves_no_threads_blocked():
    before = {t for t in threading.enumerate() if t.name == "omnilink-conformance"}
    check_connector(Tracker(), only=["blocking_get_woken", "huge_payload"], huge_bytes=1 << 20)
    after = {t for t in threading.enumerate() if t.name == "omnilink-conformance" and t.is_alive()}
    assert after <= before


# ------------------------------------------------------------------- payload zoo


def _leaves(obj, path="payload"):
    if isinstance(obj, dict):
        for k, v in obj.items():
            yield from _leaves(v, f"{path}[{k!r}]")
    elif isinstance(obj, (list, tuple)):
        for i, v in enumerate(obj):
            yield from _leaves(v, f"{path}[{i}]")
    else:
        yield path, obj


def test_zoo_covers_the_format():
    zoo = payload_zoo()
    leaves = [leaf for payload in zoo.values() for _, leaf in _leaves(payload)]
    tensors = [x for x in leaves if isinstance(x, torch.Tensor)]
    arrays = [x for x in leaves if isinstance(x, np.ndarray)]
    dtypes = {t.dtype for t in tensors}
    wanted = {
        torch.bfloat16, torch.float16, torch.float32, torch.float64, torch.int8, torch.int16,
        torch.int32, torch.int64, torch.uint8, torch.bool, torch.complex64, torch.complex128,
    }
    for name in ("float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz", "float8_e5m2fnuz", "float8_e8m0fnu",
                 "uint16", "uint32", "uint64"):
        if hasattr(torch, name):
            wanted.add(getattr(torch, name))
    assert wanted <= dtypes, wanted - dtypes
    assert {np.dtype(n) for n in ("bool", "float16", "complex64", "int64")} <= {a.dtype for a in arrays}
    assert any(t.dim() == 0 for t in tensors)
    assert any(t.numel() == 0 for t in tensors)
    assert any(not t.is_contiguous() for t in tensors)
    assert any(not a.flags.c_contiguous for a in arrays)
    assert any(isinstance(x, tuple) for p in zoo.values() for x in _containers(p))
    for kind in (None, bool, int, float, str, bytes):
        assert any(type(x) is (type(None) if kind is None else kind) for x in leaves), kind
    talker = zoo["vllm.talker_to_code2wav"]
    assert talker["codes.audio"].dtype == torch.int64 and talker["codes.audio"].dim() == 1
    assert talker["meta.finished"].dtype == torch.bool and talker["meta.finished"].dim() == 0
    assert zoo["vllm.thinker_to_talker"]["hidden_states.output"].dtype == torch.bfloat16
    assert zoo["vllm.thinker_to_talker"]["speaker"] == "Chelsie"


def _containers(obj):
    if isinstance(obj, (dict, list, tuple)):
        yield obj
        for v in obj.values() if isinstance(obj, dict) else obj:
            yield from _containers(v)


def test_zoo_is_fresh_and_deterministic_on_every_call():
    a, b = payload_zoo(), payload_zoo()
    assert_payload_equal(a, b)
    a["tensor.float32"]["t"].fill_(1.0)
    a["numpy.dtypes"]["int64"][:] = 0
    with pytest.raises(ConformanceError):
        assert_payload_equal(a, b)
    assert_payload_equal(b, payload_zoo())


def test_zoo_round_trips_through_the_codec():
    for name, payload in payload_zoo().items():
        assert_payload_equal(payload, omnilink.decode(omnilink.encode(payload)), path=name)


# -------------------------------------------------------------- payload comparison


def _bf16_with_one_bit_flipped():
    a = torch.randn(4, 4).to(torch.bfloat16)
    b = a.clone()
    b.view(torch.int16)[2, 3] ^= 1
    return a, b


@pytest.mark.parametrize(
    "a, b, fragment",
    [
        (1, True, "type bool, expected int"),
        (0.0, -0.0, "bit for bit"),
        (math.nan, -math.nan, "bit for bit"),
        ((1,), [1], "type list, expected tuple"),
        (np.arange(3), torch.arange(3), "type Tensor, expected ndarray"),
        (b"a", "a", "type str, expected bytes"),
        ({"a": 1, "b": 2}, {"b": 2, "a": 1}, "order"),
        ({"a": 1}, {"a": 1, "b": 2}, "unexpected ['b']"),
        ([1, 2], [1, 2, 3], "length 3, expected 2"),
        (torch.zeros(3), torch.zeros(3, dtype=torch.float16), "dtype torch.float16, expected torch.float32"),
        (torch.zeros(3), torch.zeros(1, 3), "shape (1, 3), expected (3,)"),
        (*_bf16_with_one_bit_flipped(), "differs from element 11"),
        (np.zeros(3, np.float32), np.zeros(3, np.float64), "dtype float64, expected float32"),
        (np.float32(1), np.float64(1), "type float64, expected float32"),
        (np.array([np.nan]), np.array([-np.nan]), "bit for bit"),
        ({"meta": {"x": (1,)}}, {"meta": {"x": [1]}}, "payload['meta']['x']"),
        ("a", "b", "'b', expected 'a'"),
        (None, 0, "type int, expected NoneType"),
    ],
)
def test_assert_payload_equal_finds_differences(a, b, fragment):
    with pytest.raises(ConformanceError) as info:
        assert_payload_equal(a, b)
    assert fragment in str(info.value), str(info.value)


@pytest.mark.parametrize(
    "make",
    [
        lambda: {"nan": math.nan, "t": torch.tensor([math.nan, -0.0, math.inf])},
        lambda: torch.randn(3, 4).t(),
        lambda: torch.randn(3, 4, dtype=torch.complex64).conj(),
        lambda: [np.array([np.nan], dtype=np.float16), (1, (2,)), {"x": b"\x00"}],
        lambda: torch.empty(0, 3, dtype=torch.bfloat16),
    ],
)
def test_assert_payload_equal_accepts_equal_payloads(make):
    a = make()
    assert_payload_equal(a, copy.deepcopy(a))
    assert_payload_equal(a, omnilink.decode(omnilink.encode(a)))
