"""The nixl sender's layout of a WRITE whose large CUDA tensors go from their own
memory: the staged runs and the direct tensors tile the data region exactly once, and
every other tensor is staged inside its run at its place."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from omnilink.connectors.nixl.connector import direct_layout


class _T:
    """A stand-in tensor (only its identity matters)."""


@settings(max_examples=300, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 3), st.integers(0, 5000), st.booleans()), min_size=1, max_size=10),
       st.integers(0, 3))
def test_staged_runs_and_direct_tensors_tile_the_data_region(specs, tail):
    sources, direct, at = [], [], 0
    for gap, nb, is_direct in specs:
        at += gap * 64
        t = _T()
        sources.append((at, nb, t))
        if is_direct and nb:
            direct.append((at, nb, t))
        at += nb
    n = at + tail * 64
    runs, where, staged, total = direct_layout(sources, direct, n)
    pieces = sorted([(o, ln, "run") for o, ln in runs] + [(o, nb, "direct") for o, nb, _t in direct])
    pos = 0
    for o, ln, _kind in pieces:
        assert o == pos and ln > 0  # no gap, no overlap, nothing empty
        pos = o + ln
    assert pos == n
    assert total == sum(ln for _o, ln in runs) == n - sum(nb for _o, nb, _t in direct)
    assert where == [sum(ln for _o, ln in runs[:i]) for i in range(len(runs))]
    direct_ids = {id(t) for *_x, t in direct}
    want = [(o, nb, t) for o, nb, t in sources if id(t) not in direct_ids]
    assert [t for *_x, t in staged] == [t for *_x, t in want]
    for (so, nb, _t), (o, _nb, _t2) in zip(staged, want):
        k = max(i for i, (ro, _ln) in enumerate(runs) if ro <= o) if nb else None
        if k is None:
            continue
        ro, ln = runs[k]
        assert o + nb <= ro + ln  # the tensor lies inside its run
        assert so == where[k] + (o - ro) and so + nb <= total


# ------------------------------------------------------------ the direct WRITE's bookkeeping
class _Agent:
    def __init__(self, stuck=False):
        self._stuck = [object()] if stuck else []
        self.registered = []
        self.deregistered = []

    def register(self, addr, nbytes, mem, dev):
        self.registered.append((addr, nbytes, mem, dev))
        return ("reg", addr)

    def deregister(self, reg):
        self.deregistered.append(reg)


class _Dev:
    """A stand-in CUDA tensor: an address and a device."""

    def __init__(self, ptr, dev=0):
        self.ptr, self.dev = ptr, dev

    def data_ptr(self):
        return self.ptr

    def get_device(self):
        return self.dev


class _Prepared:
    def __init__(self, sources, n):
        self._sources, self.data_len = sources, n

    def tensor_sources(self):
        return list(self._sources)


class _Staging:
    addr, dev = 0x5000_0000, 0

    def __init__(self):
        self.ensured = 0

    def ensure(self, n):
        self.ensured = n


def _sender(agent, post, cache=None):
    from omnilink.connectors.nixl.connector import _Sender

    s = object.__new__(_Sender)
    s.agent = agent
    s._kept_regs, s._kept_tensors = [], []
    s.regs = cache
    s.filled, s.synced = [], []
    s._fill_device = lambda prepared, staging, sources: s.filled.append(sources)
    s._sync_devices = lambda devs: s.synced.append(devs)
    s._post = post
    return s


class _Welcome:
    pool_addr, dev = 0x9000_0000, 1


def _case():
    big = _Dev(0x1000_0000)
    small = _Dev(0x2000_0000)
    sources = [(0, 128, small), (128, 1 << 20, big), (128 + (1 << 20), 1 << 20, big), (128 + (2 << 20), 64, "host")]
    direct = [(128, 1 << 20, big), (128 + (1 << 20), 1 << 20, big)]
    return big, _Prepared(sources, 128 + (2 << 20) + 64), direct


def test_a_direct_write_registers_each_tensor_once_and_lets_go_after():
    big, prepared, direct = _case()
    posted = []
    agent = _Agent()
    s = _sender(agent, lambda local, mem, remote, welcome, deadline, ahead=None, keep=False:
                posted.append((local, remote, keep)))
    staging = _Staging()
    assert s._write_direct(prepared, prepared.tensor_sources(), _Welcome(), 4096, None, staging, direct) is None
    assert agent.registered == [(big.ptr, 1 << 20, "VRAM", 0)]  # held twice: registered once
    assert agent.deregistered == [("reg", big.ptr)] and not s._kept_regs and not s._kept_tensors
    assert staging.ensured == 128 + 64 and s.synced == [{0}]
    (local, remote, keep), = posted
    assert keep  # a WRITE from the tensors' own memory keeps its request (agent.KEPT_REQUESTS)
    assert sorted(r[0] - _Welcome.pool_addr - 4096 for r in remote) == [0, 128, 128 + (1 << 20), 128 + (2 << 20)]
    assert sum(p[1] for p in local) == prepared.data_len == sum(p[1] for p in remote)


def test_a_direct_write_nixl_cannot_release_keeps_its_memory_registered_and_alive():
    big, prepared, direct = _case()
    agent = _Agent(stuck=True)
    s = _sender(agent, lambda *a, **k: "timeout")
    assert s._write_direct(prepared, prepared.tensor_sources(), _Welcome(), 0, None, _Staging(), direct) == "timeout"
    assert not agent.deregistered and s._kept_regs == [("reg", big.ptr)] and big in s._kept_tensors


def test_a_direct_write_that_fails_lets_go_of_what_it_registered():
    big, prepared, direct = _case()
    agent = _Agent()

    def boom(*a, **k):
        raise RuntimeError("post failed")

    s = _sender(agent, boom)
    try:
        s._write_direct(prepared, prepared.tensor_sources(), _Welcome(), 0, None, _Staging(), direct)
    except RuntimeError:
        pass
    else:
        raise AssertionError("the failure was swallowed")
    assert agent.deregistered == [("reg", big.ptr)] and not s._kept_regs


# ------------------------------------------------------------ with allocations registered once
def _cache(agent, allocations):
    """A registration cache over stand-in allocations ``{ptr range start: (size, id)}``."""
    from omnilink.connectors.nixl.regcache import RegistrationCache

    def allocation(ptr, dev):
        for base, (size, bid) in allocations.items():
            if base <= ptr < base + size:
                return base, size, bid
        return None

    return RegistrationCache(agent, allocation)


def test_a_direct_write_from_a_cached_allocation_registers_it_once_and_keeps_it():
    big, prepared, direct = _case()
    agent = _Agent()
    cache = _cache(agent, {0x1000_0000: (8 << 20, 7)})
    posted = []
    s = _sender(agent, lambda local, mem, remote, welcome, deadline, ahead=None, keep=False:
                posted.append((local, remote, keep)), cache)
    for _ in range(3):
        assert s._write_direct(prepared, prepared.tensor_sources(), _Welcome(), 0, None, _Staging(), direct) is None
    # The whole allocation, once, for three WRITEs; nothing deregistered after them.
    assert agent.registered == [(0x1000_0000, 8 << 20, "VRAM", 0)] and agent.deregistered == []
    assert (cache.misses, cache.hits) == (1, 2) and len(posted) == 3
    s.regs.clear()
    assert agent.deregistered == [("reg", 0x1000_0000)]


def test_a_tensor_outside_any_known_allocation_is_registered_for_its_write_alone():
    big, prepared, direct = _case()
    agent = _Agent()
    s = _sender(agent, lambda *a, **k: None, _cache(agent, {}))
    assert s._write_direct(prepared, prepared.tensor_sources(), _Welcome(), 0, None, _Staging(), direct) is None
    assert agent.registered == [(big.ptr, 1 << 20, "VRAM", 0)] and agent.deregistered == [("reg", big.ptr)]


def test_a_stuck_write_keeps_the_cached_registrations_for_good():
    big, prepared, direct = _case()
    agent = _Agent(stuck=True)
    cache = _cache(agent, {0x1000_0000: (8 << 20, 7)})
    s = _sender(agent, lambda *a, **k: "timeout", cache)
    assert s._write_direct(prepared, prepared.tensor_sources(), _Welcome(), 0, None, _Staging(), direct) == "timeout"
    assert not agent.deregistered and s._kept_regs == [("reg", 0x1000_0000)] and big in s._kept_tensors
    assert len(cache) == 0
    cache.clear()  # nothing left in it to deregister
    assert not agent.deregistered
