"""The backend registry: built-ins, register_backend, entry points, option errors."""

from __future__ import annotations

from importlib.metadata import EntryPoint

import pytest

import omnilink
from omnilink import connectors
from omnilink.connectors.memory import MemoryConnector


@pytest.fixture
def fresh_registry(monkeypatch):
    """An empty third-party registry whose entry points are read again."""
    monkeypatch.setattr(connectors, "_registered", {})
    monkeypatch.setattr(connectors, "_entry_points_loaded", False)
    monkeypatch.setattr(connectors, "entry_points", lambda group: [])
    return connectors


def test_builtins_are_listed(fresh_registry):
    names = omnilink.available_backends()
    assert {"memory", "shm", "zmq", "nccl"} <= set(names)
    assert names == sorted(names)


def test_unknown_backend_names_the_alternatives(fresh_registry):
    with pytest.raises(omnilink.ConfigurationError) as info:
        omnilink.connect("carrier-pigeon", channel="reg/a")
    message = str(info.value)
    assert "carrier-pigeon" in message
    for name in ("memory", "shm", "zmq", "nccl"):
        assert name in message


def test_connect_memory_returns_a_connector(fresh_registry):
    with omnilink.connect("memory", channel="reg/mem", role="dual") as conn:
        assert isinstance(conn, MemoryConnector)
        assert isinstance(conn, omnilink.Connector)
        assert (conn.backend, conn.channel, conn.role) == ("memory", "reg/mem", "dual")


def test_register_backend_and_refuse_duplicates(fresh_registry):
    opened = []

    def factory(**options):
        conn = MemoryConnector(**options)
        opened.append(conn)
        return conn

    omnilink.register_backend("loopback", factory)
    assert "loopback" in omnilink.available_backends()
    with omnilink.connect("loopback", channel="reg/lb", role="dual") as conn:
        assert opened == [conn]
        conn.put("k", {"x": 1})
        assert conn.get("k", timeout=5) == {"x": 1}

    with pytest.raises(omnilink.ConfigurationError, match="already registered"):
        omnilink.register_backend("loopback", factory)
    with pytest.raises(omnilink.ConfigurationError, match="already registered"):
        omnilink.register_backend("memory", factory)

    def other(**options):
        raise omnilink.CapacityError("the replacement was called")

    omnilink.register_backend("loopback", other, replace=True)
    with pytest.raises(omnilink.CapacityError, match="replacement"):
        omnilink.connect("loopback", channel="reg/lb")


@pytest.mark.parametrize("name", ["", None, 3])
def test_register_backend_refuses_bad_names(fresh_registry, name):
    with pytest.raises(omnilink.ConfigurationError):
        omnilink.register_backend(name, MemoryConnector)


def test_register_backend_refuses_non_callables(fresh_registry):
    with pytest.raises(omnilink.ConfigurationError, match="not callable"):
        omnilink.register_backend("thing", object())
    assert "thing" not in omnilink.available_backends()


def _fake_entry_points(*eps):
    calls = []

    def entry_points(*, group):
        calls.append(group)
        return [ep for ep in eps if ep.group == group]

    return entry_points, calls


def test_entry_point_is_discovered(monkeypatch, fresh_registry):
    group = connectors.ENTRY_POINT_GROUP
    assert group == "omnilink.connectors"
    fake, calls = _fake_entry_points(
        EntryPoint("thirdparty", "omnilink.connectors.memory:MemoryConnector", group),
        # Our own distribution's declaration of a built-in must not shadow it.
        EntryPoint("memory", "nowhere.at.all:Nothing", group),
        EntryPoint("unrelated", "nowhere:Nothing", "some.other.group"),
    )
    monkeypatch.setattr(connectors, "entry_points", fake)
    names = omnilink.available_backends()
    assert calls == [group]
    assert "thirdparty" in names and "unrelated" not in names
    with omnilink.connect("thirdparty", channel="reg/ep", role="dual") as conn:
        assert isinstance(conn, MemoryConnector)
    with omnilink.connect("memory", channel="reg/ep2") as conn:
        assert isinstance(conn, MemoryConnector)
    # Entry points are read once.
    omnilink.available_backends()
    assert calls == [group]
    with pytest.raises(omnilink.ConfigurationError, match="already registered"):
        omnilink.register_backend("thirdparty", MemoryConnector)


def test_broken_entry_points_are_configuration_errors(monkeypatch, fresh_registry):
    group = connectors.ENTRY_POINT_GROUP
    fake, _ = _fake_entry_points(
        EntryPoint("missing-module", "omnilink_no_such_module_xyz:Connector", group),
        EntryPoint("missing-attr", "omnilink.connectors.memory:NoSuchConnector", group),
    )
    monkeypatch.setattr(connectors, "entry_points", fake)
    with pytest.raises(omnilink.ConfigurationError, match="missing-module") as info:
        omnilink.connect("missing-module", channel="reg/x")
    assert isinstance(info.value.__cause__, ImportError)
    with pytest.raises(omnilink.ConfigurationError, match="missing-attr"):
        omnilink.connect("missing-attr", channel="reg/x")


@pytest.mark.parametrize(
    "options, fragment",
    [
        ({"channel": "reg/o", "bogus": 1}, "bogus"),
        ({}, "channel"),
        ({"channel": "bad channel!"}, "channel"),
        ({"channel": ""}, "channel"),
        ({"channel": 7}, "channel"),
        ({"channel": "reg/o", "role": "listener"}, "role"),
        ({"channel": "reg/o", "timeout": -1}, "timeout"),
        ({"channel": "reg/o", "timeout": "soon"}, "timeout"),
        ({"channel": "reg/o", "capacity_bytes": 0}, "capacity_bytes"),
        ({"channel": "reg/o", "capacity_bytes": -5}, "capacity_bytes"),
        ({"channel": "reg/o", "capacity_bytes": True}, "capacity_bytes"),
        ({"channel": "reg/o", "capacity_bytes": 1.5}, "capacity_bytes"),
    ],
)
def test_bad_options_are_configuration_errors(fresh_registry, options, fragment):
    from omnilink.connectors import memory

    with pytest.raises(omnilink.ConfigurationError, match=fragment):
        omnilink.connect("memory", **options)
    # A refused connector leaves no channel behind.
    assert "reg/o" not in memory._channels
