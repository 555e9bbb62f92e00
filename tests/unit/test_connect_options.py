"""``connect``'s options: "did you mean" for unknown names, per-backend typing, ``release``."""

from __future__ import annotations

import pathlib
import subprocess
import sys
import textwrap

import pytest

import omnilink
from omnilink.connectors import register_backend

REPO = pathlib.Path(__file__).resolve().parents[2]


@pytest.mark.parametrize(
    "backend, typo, suggestion",
    [("shm", "arena_byte", "arena_bytes"), ("memory", "capacity", "capacity_bytes"),
     ("zmq", "endpont", "endpoint"), ("nccl", "master_prot", "master_port"), ("shm", "rol", "role")],
)
def test_unknown_option_says_did_you_mean(backend, typo, suggestion):
    with pytest.raises(omnilink.ConfigurationError) as info:
        omnilink.connect(backend, channel="typo-check", **{typo: 1})
    msg = str(info.value)
    assert f"{typo!r} (did you mean {suggestion!r}?)" in msg and f"backend {backend!r}" in msg
    assert "valid options:" in msg and suggestion in msg.split("valid options:")[1]


def test_unknown_options_without_a_close_match_list_the_valid_ones():
    with pytest.raises(omnilink.ConfigurationError) as info:
        omnilink.connect("memory", channel="typo-check", zzz=1, capacity_bytes=10)
    msg = str(info.value)
    assert "'zzz'" in msg and "did you mean" not in msg
    assert "capacity_bytes, channel, role, timeout" in msg


def test_factories_taking_kwargs_check_their_own_options():
    seen = {}

    def factory(**options):
        seen.update(options)
        return omnilink.connect("memory", channel=options["channel"])

    register_backend("kwargs-factory-test", factory, replace=True)
    with omnilink.connect("kwargs-factory-test", channel="kw", anything=1) as conn:
        assert seen == {"channel": "kw", "anything": 1}
        assert isinstance(conn, omnilink.Connector)


def test_release_is_part_of_the_protocol():
    assert "release" in dir(omnilink.Connector)
    with omnilink.connect("memory", channel="release-check") as conn:
        assert isinstance(conn, omnilink.Connector)
        conn.put("k", {"x": 1})
        assert conn.get("k") == {"x": 1}
        assert conn.release("k") is False   # memory payloads own their memory
    with pytest.raises(omnilink.ClosedError):
        conn.release("k")


def test_connect_is_typed_per_backend(tmp_path):
    # What an IDE and mypy see: the class of each built-in backend, its options.
    snippet = tmp_path / "typed.py"
    snippet.write_text(textwrap.dedent(
        """\
        import omnilink
        reveal_type(omnilink.connect("shm", channel="c", arena_bytes=1 << 20))
        reveal_type(omnilink.connect("zmq", channel="c", endpoint="tcp://127.0.0.1:*"))
        reveal_type(omnilink.connect("nccl", channel="c", backend="gloo", master_port=0))
        reveal_type(omnilink.connect("memory", channel="c", capacity_bytes=10))
        reveal_type(omnilink.connect("cuda_ipc", channel="c", pool_bytes=1 << 20))
        reveal_type(omnilink.connect("mybackend", channel="c", whatever=1))
        with omnilink.connect("shm", channel="c") as rx:
            reveal_type(rx)
            reveal_type(rx.release("k"))
        """
    ))
    r = subprocess.run([sys.executable, "-m", "mypy", "--strict", "--follow-imports=silent",
                        "--cache-dir", str(REPO / ".mypy_cache"), "--no-error-summary", str(snippet)],
                       cwd=REPO, capture_output=True, text=True, timeout=600)
    revealed = [line.split("Revealed type is ")[1].strip('"') for line in r.stdout.splitlines()
                if "Revealed type is" in line]
    assert revealed == [
        "omnilink.connectors.shm.connector.ShmConnector",
        "omnilink.connectors.zmq.connector.ZmqConnector",
        "omnilink.connectors.nccl.connector.NcclConnector",
        "omnilink.connectors.memory.MemoryConnector",
        "omnilink.connectors.cuda_ipc.connector.CudaIpcConnector",
        "omnilink.connectors.base.Connector",
        "omnilink.connectors.shm.connector.ShmConnector",
        "bool",
    ], r.stdout
