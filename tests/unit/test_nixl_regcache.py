"""The nixl sender's cache of registered CUDA allocations: one registration per
allocation, an allocation's registration used only for that allocation (its buffer id),
one over freed addresses dropped, the least recently used dropped past the bound."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from omnilink.connectors.nixl.regcache import RegistrationCache


class _Agent:
    def __init__(self):
        self.live = {}  # descs -> (addr, nbytes, dev)
        self.n = 0
        self.log = []

    def register(self, addr, nbytes, mem, dev):
        assert mem == "VRAM"
        self.n += 1
        descs = ("reg", self.n)
        self.live[descs] = (addr, nbytes, dev)
        self.log.append(("reg", addr, nbytes))
        return descs

    def deregister(self, descs):
        assert descs in self.live, "deregistered twice or never registered"
        addr, nbytes, _dev = self.live.pop(descs)
        self.log.append(("dereg", addr, nbytes))


class _Driver:
    """Stand-in allocations: ``{base: (size, buffer id)}`` per device."""

    def __init__(self):
        self.allocs = {0: {}, 1: {}}

    def __call__(self, ptr, dev):
        for base, (size, bid) in self.allocs[dev].items():
            if base <= ptr < base + size:
                return base, size, bid
        return None


def test_tensors_of_one_allocation_share_its_registration():
    agent, drv = _Agent(), _Driver()
    drv.allocs[0][0x1000] = (1 << 20, 1)
    c = RegistrationCache(agent, drv)
    assert c.covers(0x1000, 4096, 0) and c.covers(0x1000 + 8192, 65536, 0) and c.covers(0x1000, 1 << 20, 0)
    assert agent.log == [("reg", 0x1000, 1 << 20)] and (c.misses, c.hits) == (1, 2)


def test_a_range_past_its_allocation_or_unknown_memory_is_not_covered():
    agent, drv = _Agent(), _Driver()
    drv.allocs[0][0x1000] = (4096, 1)
    c = RegistrationCache(agent, drv)
    assert not c.covers(0x1800, 4096, 0)  # runs past the allocation's end
    assert not c.covers(0x9000_0000, 64, 0)  # no allocation the driver knows
    assert agent.log == [] and len(c) == 0


def test_a_new_allocation_over_freed_addresses_replaces_the_old_registration():
    agent, drv = _Agent(), _Driver()
    drv.allocs[0][0x1000] = (1 << 20, 1)
    c = RegistrationCache(agent, drv)
    assert c.covers(0x1000, 64, 0)
    # Freed; a larger allocation now starts at the same address (a new buffer id).
    drv.allocs[0] = {0x1000: (4 << 20, 2)}
    assert c.covers(0x1000, 64, 0)
    assert agent.log == [("reg", 0x1000, 1 << 20), ("dereg", 0x1000, 1 << 20), ("reg", 0x1000, 4 << 20)]
    # Same addresses and size, new allocation: not taken for the old one either.
    drv.allocs[0] = {0x1000: (4 << 20, 3)}
    assert c.covers(0x1000, 64, 0) and agent.log[-2:] == [("dereg", 0x1000, 4 << 20), ("reg", 0x1000, 4 << 20)]
    assert len(agent.live) == 1 == len(c)


def test_devices_are_apart():
    agent, drv = _Agent(), _Driver()
    drv.allocs[0][0x1000] = (4096, 1)
    drv.allocs[1][0x1000] = (4096, 1)
    c = RegistrationCache(agent, drv)
    assert c.covers(0x1000, 64, 0) and c.covers(0x1000, 64, 1)
    assert len(agent.live) == 2 == len(c)


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 11), st.booleans()), min_size=1, max_size=60), st.integers(1, 5))
def test_at_most_max_entries_stay_registered_and_each_is_current(ops, most):
    """Random uses and frees of twelve address slots: never more than ``most``
    registrations live, none overlaps another, the one a use finds is of the allocation
    the driver has now, and clear() leaves none."""
    agent, drv = _Agent(), _Driver()
    c = RegistrationCache(agent, drv, max_entries=most)
    next_id = [0]

    def alloc(slot):
        next_id[0] += 1
        drv.allocs[0][slot << 24] = (1 << 20, next_id[0])

    for slot, free in ops:
        base = slot << 24
        if free and base in drv.allocs[0]:
            del drv.allocs[0][base]
            continue
        if base not in drv.allocs[0]:
            alloc(slot)
        assert c.covers(base + 128, 64, 0)
        assert len(agent.live) == len(c) <= most
        size, _bid = drv.allocs[0][base]
        assert (base, size, 0) in agent.live.values()
        # No two live registrations overlap.
        spans = sorted((a, a + n) for a, n, _d in agent.live.values())
        assert all(e <= s for (_s, e), (s, _e) in zip(spans, spans[1:]))
    c.clear()
    assert agent.live == {} and len(c) == 0


def test_an_allocation_the_agent_will_not_register_whole_is_left_to_per_write_registration():
    """Where registering the whole allocation fails (a range only partly mapped, as
    torch's expandable segments make), the tensor is not covered: its WRITE registers
    it alone, and nothing is left half-registered."""
    agent, drv = _Agent(), _Driver()
    drv.allocs[0][0x1000] = (1 << 30, 1)

    def register(addr, nbytes, mem, dev):
        if nbytes > (1 << 20):
            raise RuntimeError("nixl: registering 1073741824 bytes of VRAM failed")
        return _Agent.register(agent, addr, nbytes, mem, dev)

    agent.register = register
    c = RegistrationCache(agent, drv)
    assert not c.covers(0x1000, 4096, 0) and not c.covers(0x2000, 64, 0)
    assert c.refused == 1 and len(c) == 0 and agent.live == {}  # tried once, not per write
    drv.allocs[0] = {0x1000: (1 << 20, 2)}  # that memory freed; a new allocation there
    assert c.covers(0x1000, 4096, 0) and len(c) == 1


def test_an_allocation_holding_the_senders_own_registration_is_never_registered_whole():
    """NIXL's registrations must not overlap: the allocation that holds the sender's
    staging buffer is not registered whole (its tensors register per write), and one
    registered before the staging buffer moved into it is deregistered."""
    agent, drv = _Agent(), _Driver()
    drv.allocs[0][0x10_0000] = (20 << 20, 1)  # a segment holding a tensor and the staging
    drv.allocs[0][0x800_0000] = (1 << 20, 2)
    c = RegistrationCache(agent, drv)
    c.avoid(0, 0x10_0000 + (4 << 20), 1 << 20)
    assert not c.covers(0x10_0000, 1 << 20, 0)
    assert not c.covers(0x10_0000, 1 << 20, 0)  # remembered: not looked at again
    assert agent.log == [] and c.refused == 1
    assert c.covers(0x800_0000, 4096, 0)  # another allocation: registered whole
    # The staging buffer moves into an allocation already registered whole.
    c.avoid(0, 0x800_0000 + 8192, 4096)
    assert agent.log[-1] == ("dereg", 0x800_0000, 1 << 20) and len(c) == 0
    assert not c.covers(0x800_0000, 4096, 0)
    assert not agent.live
    # On another device the range means nothing.
    drv.allocs[1][0x10_0000] = (20 << 20, 3)
    assert c.covers(0x10_0000, 4096, 1)


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["covers", "avoid"]), st.integers(0, 7), st.integers(0, 3)),
                max_size=40))
def test_no_registration_of_the_cache_ever_overlaps_the_avoided_range(steps):
    agent, drv = _Agent(), _Driver()
    for i in range(8):
        drv.allocs[0][i << 24] = (1 << 24, i + 1)
    c = RegistrationCache(agent, drv, max_entries=3)
    avoided = None
    for op, alloc, part in steps:
        addr = (alloc << 24) + part * (1 << 20)
        if op == "avoid":
            c.avoid(0, addr, 1 << 20)
            avoided = (addr, 1 << 20)
        else:
            c.covers(addr, 4096, 0)
        if avoided is not None:
            for a, n, _d in agent.live.values():
                assert not (a < avoided[0] + avoided[1] and avoided[0] < a + n)
        assert len(agent.live) == len(c) <= 3
