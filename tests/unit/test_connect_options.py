"""``connect``'s options: "did you mean" for unknown names, per-backend typing, ``release``."""

from __future__ import annotations

import pathlib
import re
import shutil
import subprocess
import sys
from collections.abc import Iterable
from typing import Literal

import pytest

import omnilink
from omnilink.connectors import check_backend_options, register_backend

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


# What an IDE and mypy see, in one mypy run: the class of each built-in backend; the
# four typos of issue 28 (an option name, a role, a value's type, a backend name) are
# errors on their own lines; a third party's backend opens by name via connect_backend.
_TYPED = """\
import omnilink
reveal_type(omnilink.connect("shm", channel="c", arena_bytes=1 << 20))
reveal_type(omnilink.connect("zmq", channel="c", endpoint="tcp://127.0.0.1:*"))
reveal_type(omnilink.connect("nccl", channel="c", backend="gloo", master_port=0))
reveal_type(omnilink.connect("memory", channel="c", capacity_bytes=10))
reveal_type(omnilink.connect("cuda_ipc", channel="c", pool_bytes=1 << 20))
reveal_type(omnilink.connect_backend("mybackend", channel="c", whatever=1))
with omnilink.connect("shm", channel="c") as rx:
    reveal_type(rx)
    reveal_type(rx.release("k"))
name: str = "mybackend"
reveal_type(omnilink.connect_backend(name, channel="c"))
omnilink.connect("shm", channel="c", arena_byte=1 << 20)  # typo: arena_byte
omnilink.connect("shm", channel="c", role="sendr")  # typo: role
omnilink.connect("shm", channel="c", arena_bytes="big")  # typo: arena_bytes
omnilink.connect("shmm", channel="c")  # typo: shmm
"""


def test_connect_is_typed_per_backend(tmp_path):
    snippet = tmp_path / "typed.py"
    snippet.write_text(_TYPED)
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
        "omnilink.connectors.base.Connector",
    ], r.stdout
    lines = _TYPED.splitlines()
    typo_lines = {i + 1 for i, text in enumerate(lines) if "# typo:" in text}
    error_lines = {int(line.split(":")[1]) for line in r.stdout.splitlines() if ": error:" in line}
    # Every typo is an error, and nothing else is (the third-party lines pass).
    assert error_lines == typo_lines, r.stdout
    assert r.returncode == 1, r.stdout


# ---------------------------------------------------------------- check_backend_options
class _ThirdParty:
    """A third party's backend: its signature is its option schema."""

    def __init__(self, *, channel: str, role: Literal["sender", "receiver", "dual"] = "dual",
                 window: int = 4, ratio: float | None = None, tags: Iterable[str] = ()) -> None:
        raise AssertionError("check_backend_options must not open the backend")

    @staticmethod
    def check_options(options: dict) -> None:
        if options.get("window", 4) > 64:
            raise omnilink.ConfigurationError("window must be <= 64")


@pytest.mark.parametrize(
    "options, message",
    [
        ({"windw": 1}, "'windw' (did you mean 'window'?)"),
        ({"role": "sendr"}, "option 'role' of backend 'third-party-test' must be one of 'sender', 'receiver', 'dual'"),
        ({"window": True}, "option 'window' of backend 'third-party-test' must be an int, got True"),
        ({"ratio": "half"}, "must be a number or None"),
        ({"tags": "a,b"}, "must be a list of str"),
        ({"tags": ["a", 1]}, "must be a list of str"),
        ({"window": 65}, "window must be <= 64"),  # the backend's own hook
    ],
)
def test_check_backend_options_uses_the_backends_own_schema(options, message):
    register_backend("third-party-test", _ThirdParty, replace=True)
    with pytest.raises(omnilink.ConfigurationError) as info:
        check_backend_options("third-party-test", {"channel": "c", **options}, where="here: ")
    assert message in str(info.value) and str(info.value).startswith("here: ")
    check_backend_options("third-party-test", {"channel": "c", "role": "sender", "window": 64,
                                               "ratio": 1, "tags": ["a"]})


def test_check_backend_options_of_the_builtins():
    check_backend_options("shm", {"channel": "c", "arena_bytes": 1 << 20, "max_bytes": None, "linger": 1})
    # A list for the Iterable[str | bytes] option; its items are well-formed Z85 keys (40
    # characters), since values are checked as the constructor checks them ("k" is not).
    check_backend_options("zmq", {"endpoint": "tcp://127.0.0.1:5555", "role": "receiver",
                                  "curve_secret_key": "0" * 40, "curve_allowed_clients": ["1" * 40]})
    with pytest.raises(omnilink.ConfigurationError, match="'arena_bytes' of backend 'shm' must be an int"):
        check_backend_options("shm", {"arena_bytes": 1.5})
    with pytest.raises(omnilink.ConfigurationError, match="did you mean 'endpoint'"):
        check_backend_options("zmq", {"endpont": "tcp://x:1"})


@pytest.mark.skipif(shutil.which("pyright") is None,
                    reason="pyright is not installed (pip install pyright; its wrapper fetches the "
                           "pyright npm package on first use, so it is not in the test extra)")
def test_pyright_rejects_the_same_typos(tmp_path):
    snippet = tmp_path / "typed.py"
    snippet.write_text(_TYPED)
    r = subprocess.run(["pyright", "--pythonpath", sys.executable, str(snippet)],
                       cwd=REPO, capture_output=True, text=True, timeout=600)
    errors = {int(m.group(1)) for m in re.finditer(r"typed\.py:(\d+):\d+ - error", r.stdout)}
    typo_lines = {i + 1 for i, text in enumerate(_TYPED.splitlines()) if "# typo:" in text}
    assert errors == typo_lines, r.stdout
