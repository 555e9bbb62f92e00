"""``omnilink`` command line: option parsing, usage errors, ``info`` and ``gc``.

The benchmark itself runs end to end in tests/integration/test_bench_cli.py; here every
call returns before measuring anything.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys

import pytest

import omnilink
from omnilink import ConfigurationError
from omnilink._bench.units import format_size, parse_size, parse_sizes
from omnilink.cli import main


# ------------------------------------------------------------------------- sizes
@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("4KiB", 4096),
        ("16MiB", 16 << 20),
        ("1GiB", 1 << 30),
        ("64KB", 64_000),
        ("2MB", 2_000_000),
        ("1.5KiB", 1536),
        ("4096", 4096),
        ("4096B", 4096),
        (" 8kib ", 8192),
        ("4k", 4096),
    ],
)
def test_parse_size(text, expected):
    assert parse_size(text) == expected


@pytest.mark.parametrize("text", ["", "KiB", "4XB", "-4KiB", "3", "1.3B", "banana", "9GiB", "4 Ki B"])
def test_parse_size_rejects(text):
    with pytest.raises(ConfigurationError):
        parse_size(text)


def test_parse_sizes_sorted_unique():
    assert parse_sizes("16MiB,4KiB,4096,64KiB") == [4096, 64 << 10, 16 << 20]
    with pytest.raises(ConfigurationError, match="at least one"):
        parse_sizes(" , ")


@pytest.mark.parametrize(("n", "text"), [(4096, "4KiB"), (1536, "1.5KiB"), (100, "100B"),
                                         (256 << 20, "256MiB"), (1 << 30, "1GiB")])
def test_format_size(n, text):
    assert format_size(n) == text


# ----------------------------------------------------------------- usage errors
@pytest.mark.parametrize(
    ("argv", "needle"),
    [
        (["bench", "--sizes", "4XiB"], "--sizes"),
        (["bench", "--sizes", "3"], "even"),
        (["bench", "--backends", "pickle-shm,nope"], "nope"),
        (["bench", "--backends", "h2d-pinned"], "h2d-pinned"),  # a gpu backend, CPU scenario
        (["bench", "--repeat", "0"], "--repeat"),
        (["bench", "--max-seconds", "0"], "--max-seconds"),
        (["bench", "--timeout", "-1"], "--timeout"),
        (["bench", "--mode", "fast"], "--mode"),
        (["bench", "nosuchscenario"], "SCENARIO"),
        (["bench", "shm-vs-pickle", "--scenario", "gpu"], "scenario given twice"),
        (["bench", "--repeat", "many"], "--repeat"),
        (["frobnicate"], "invalid choice"),
        (["gc", "--prefix"], "--prefix"),
    ],
)
def test_bad_options_exit_2_with_message(argv, needle, capsys):
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert needle in err


def test_no_command_prints_help_and_fails(capsys):
    assert main([]) == 2
    assert "bench" in capsys.readouterr().err


@pytest.mark.parametrize("flag", ["--version", "-V"])
def test_version(flag, capsys):
    assert main([flag]) == 0
    assert capsys.readouterr().out == f"omnilink {omnilink.__version__}\n"


def test_version_matches_the_distribution():
    from importlib import metadata

    try:
        installed = metadata.version("pyomnilink")  # the distribution of the omnilink package
    except metadata.PackageNotFoundError:  # pragma: no cover - make test installs it
        pytest.skip("omnilink is not installed (pip install -e .)")
    assert installed == omnilink.__version__


def test_help_exits_0(capsys):
    assert main(["bench", "--help"]) == 0
    out = capsys.readouterr().out
    for option in ("--sizes", "--mode", "--backends", "--repeat", "--max-seconds", "--json", "--plot"):
        assert option in out


def test_unwritable_json_fails_before_measuring(tmp_path, capsys):
    target = tmp_path / "missing-dir" / "out.jsonl"
    assert main(["bench", "--sizes", "4KiB", "--json", str(target)]) == 2
    err = capsys.readouterr().err
    assert "cannot write" in err and "missing-dir" in err


def test_plot_without_matplotlib_says_what_to_install(monkeypatch, tmp_path, capsys):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import now raises ImportError
    assert main(["bench", "--sizes", "4KiB", "--plot", str(tmp_path / "p.png")]) == 2
    assert "pip install matplotlib" in capsys.readouterr().err
    assert not (tmp_path / "p.png").exists()


def test_gpu_scenario_without_cuda_fails_clearly(capsys):
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA; the no-CUDA message cannot be shown")
    for argv in (["bench", "gpu"], ["bench", "--scenario", "gpu", "--sizes", "4KiB"]):
        assert main(argv) == 1
        err = capsys.readouterr().err
        assert "CUDA is not available" in err
    assert not torch.cuda.is_initialized()


# ------------------------------------------------------------------------- info
def test_info_text(capsys):
    assert main(["info"]) == 0
    out = capsys.readouterr().out
    for word in ("omnilink", "python", "torch", "msgspec", "pyzmq", "posix_ipc", "backends:",
                 "memory", "/dev/shm", "cuda"):
        assert word in out


def test_info_json(capsys):
    import omnilink

    assert main(["info", "--json"]) == 0
    rec = json.loads(capsys.readouterr().out)
    assert rec["versions"]["omnilink"] == omnilink.__version__
    assert set(rec["versions"]) >= {"python", "torch", "numpy", "msgspec", "pyzmq", "posix_ipc"}
    assert set(rec["backends"]) == set(omnilink.available_backends())
    assert rec["backends"]["memory"] == "ok"
    if os.path.isdir("/dev/shm"):
        assert rec["shm"]["size_bytes"] >= rec["shm"]["free_bytes"] > 0
    assert isinstance(rec["cuda_devices"], list)


def test_info_never_initialises_cuda():
    # In a fresh interpreter: `info` may ask whether CUDA exists, never set it up.
    code = (
        "import torch\n"
        "from omnilink.cli import main\n"
        "import contextlib, io\n"
        "with contextlib.redirect_stdout(io.StringIO()):\n"
        "    assert main(['info']) == 0\n"
        "print(torch.cuda.is_initialized() == torch.cuda.is_available())\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    # With CUDA present listing devices is allowed to initialise; without, never.
    assert out.stdout.strip() == "True"


def test_machine_record_is_hostname_free():
    from omnilink._bench.machine import machine_record

    rec = machine_record()
    assert {"cpu", "cores", "memory_bytes", "shm", "os", "versions"} <= set(rec)
    text = json.dumps(rec)
    host = socket.gethostname()
    if len(host) >= 4:
        assert host not in text


# --------------------------------------------------------------------------- gc
def _dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait(timeout=60)
    return proc.pid


def test_gc_dry_run_then_remove(capsys):
    pytest.importorskip("omnilink.connectors.shm", reason="the shm backend is not in this tree")
    prefix = os.environ["OMNILINK_SHM_PREFIX"]
    # What a dead sender's overflow segment looks like (see connectors/_shm_names.py).
    name = f"{prefix}-o{_dead_pid()}-0123456789abcdef"
    path = os.path.join("/dev/shm", name)
    fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
    os.close(fd)
    try:
        assert main(["gc", "--dry-run", "--prefix", prefix]) == 0
        out = capsys.readouterr().out
        assert f"would remove {name}" in out
        assert os.path.exists(path)

        assert main(["gc"]) == 0  # default prefix: $OMNILINK_SHM_PREFIX
        out = capsys.readouterr().out
        assert f"removed {name}" in out and "1 entry removed" in out
        assert not os.path.exists(path)
    finally:
        if os.path.exists(path):
            os.unlink(path)


def test_gc_nothing_to_do(capsys):
    pytest.importorskip("omnilink.connectors.shm", reason="the shm backend is not in this tree")
    assert main(["gc", "--dry-run", "--prefix", os.environ["OMNILINK_SHM_PREFIX"] + "-none"]) == 0
    assert "0 entries would be removed" in capsys.readouterr().out


def test_gc_bad_prefix(capsys):
    pytest.importorskip("omnilink.connectors.shm", reason="the shm backend is not in this tree")
    assert main(["gc", "--dry-run", "--prefix", "a/b"]) == 2
    assert "prefix" in capsys.readouterr().err


def test_gc_removes_the_ipc_files_of_dead_zmq_receivers(capsys, monkeypatch, tmp_path):
    pytest.importorskip("zmq")
    import socket

    from omnilink.connectors.zmq.support import EndpointLock

    ipc = tmp_path / "ipc"
    ipc.mkdir(mode=0o700)
    monkeypatch.setenv("OMNILINK_ZMQ_DIR", str(ipc))
    prefix = os.environ["OMNILINK_SHM_PREFIX"]

    def endpoint(name):
        sock_path = ipc / f"{prefix}-zmq-{name}.sock"
        s = socket.socket(socket.AF_UNIX)
        s.bind(str(sock_path))
        s.close()  # the file stays, as after a SIGKILL
        return sock_path, ipc / f"{prefix}-zmq-{name}.lock"

    dead_sock, dead_lock = endpoint("dead")
    dead_lock.write_bytes(b"")  # nobody holds its flock: the receiver died
    live_sock, live_lock = endpoint("live")
    held = EndpointLock(str(live_lock), channel="live")  # a live receiver's lock
    try:
        assert main(["gc", "--dry-run"]) == 0
        assert f"would remove {dead_sock}" in capsys.readouterr().out
        assert dead_sock.exists()
        assert main(["gc"]) == 0
        out = capsys.readouterr().out
        assert f"removed {dead_sock}" in out and f"removed {dead_lock}" in out
        assert not dead_sock.exists() and not dead_lock.exists()
        assert live_sock.exists() and live_lock.exists()
    finally:
        held.release()
        live_sock.unlink()


def test_gc_cuda_removes_driver_event_files_of_dead_processes_only(capsys):
    """``omnilink gc --cuda``: the CUDA driver's ``cuda.shm.<n>.<pid hex>.<n>`` files of
    dead processes go; a live process's file and other names stay; without ``--cuda``
    nothing of the driver's is touched."""
    pytest.importorskip("omnilink.connectors.shm", reason="the shm backend is not in this tree")
    # Suffixes the driver does not use (.1 is its own: on a GPU machine this process may
    # already have that file, made by earlier tests).
    dead = f"cuda.shm.0.{_dead_pid():x}.4242"
    live = f"cuda.shm.0.{os.getpid():x}.4242"
    other = f"cuda.shm.0.{_dead_pid():x}.x"  # not the driver's pattern
    paths = [os.path.join("/dev/shm", n) for n in (dead, live, other)]
    for path in paths:
        fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
        os.close(fd)
    try:
        assert main(["gc", "--dry-run"]) == 0
        assert dead not in capsys.readouterr().out
        assert main(["gc", "--cuda", "--dry-run"]) == 0
        out = capsys.readouterr().out
        assert f"would remove {dead}" in out and live not in out and other not in out
        assert all(os.path.exists(p) for p in paths)
        assert main(["gc", "--cuda"]) == 0
        out = capsys.readouterr().out
        assert f"removed {dead}" in out
        assert not os.path.exists(paths[0]) and os.path.exists(paths[1]) and os.path.exists(paths[2])
    finally:
        for path in paths:
            if os.path.exists(path):
                os.unlink(path)
