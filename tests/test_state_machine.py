"""Hypothesis state machine: put/get/evict/corrupt/close/reopen/crash under capacity pressure
(16 slots, 24 keys, LRU) against a model of what may be stored."""

from __future__ import annotations

import os
import shutil
import tempfile

import hypothesis.strategies as st
from hypothesis import HealthCheck, settings
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from gdskv.tier import Tier
from reliability_helpers import (LAYOUT, PAGE, SLOT, check_pages, put, ready_keys, slot_location,
                                 small_config)

KEYS = [f"s{i}" for i in range(24)] + [b"\x00raw", "../../etc/passwd"]
batches = st.lists(st.sampled_from(KEYS), min_size=1, max_size=6, unique=True)


class TierMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.dir = tempfile.mkdtemp(prefix="gdskv-sm-")
        self.cfg = small_config(self.dir, capacity=16 * SLOT)
        self.tier = Tier(LAYOUT, self.cfg, device="cpu")
        assert self.tier.store.num_slots == 16
        self.maybe: set = set()      # keys that may be stored (LRU can drop any unpinned one)
        self.corrupt: set = set()    # stored keys whose payload we damaged on disk

    def teardown(self) -> None:
        if not self.tier._closed:
            self.tier.close()
        shutil.rmtree(self.dir, ignore_errors=True)

    @rule(keys=batches)
    def put(self, keys):
        fresh = [k for k in keys if not self.tier.contains(k)]
        assert put(self.tier, keys) == [True] * len(keys)  # nothing pinned: LRU makes room
        for k in keys:
            assert self.tier.contains(k)
        self.maybe.update(keys)
        self.corrupt.difference_update(fresh)  # a fresh copy replaced any damaged one

    @rule(keys=batches)
    def get(self, keys):
        stored = {k for k in keys if self.tier.contains(k)}
        res = check_pages(self.tier, keys)
        assert not res["wrong"], res["wrong"]
        hits = set(keys) - set(res["missed"])
        assert hits <= self.maybe
        assert hits == stored - self.corrupt, (hits, stored, self.corrupt)
        for k in stored & self.corrupt:  # detected: dropped from the directory
            assert not self.tier.contains(k)
        self.corrupt -= stored
        self.maybe -= stored - hits

    @rule(keys=batches)
    def evict(self, keys):
        self.tier.evict(keys)
        for k in keys:
            assert not self.tier.contains(k)
        self.maybe.difference_update(keys)
        self.corrupt.difference_update(keys)

    @precondition(lambda self: set(ready_keys(self.tier)) - self.corrupt)
    @rule(data=st.data())
    def damage(self, data):
        # one flip per page: a second XOR at the same byte would undo the first
        key = data.draw(st.sampled_from(sorted(set(ready_keys(self.tier)) - self.corrupt,
                                               key=repr)))
        path, off = slot_location(self.tier, key)
        pos = off + data.draw(st.integers(0, PAGE - 1))
        fd = os.open(path, os.O_RDWR)
        try:
            os.pwrite(fd, bytes([os.pread(fd, 1, pos)[0] ^ 0x40]), pos)
        finally:
            os.close(fd)
        self.corrupt.add(key)

    @rule()
    def reopen(self):
        before = set(ready_keys(self.tier))
        self.tier.close()
        self.tier = Tier(LAYOUT, self.cfg, device="cpu")
        assert set(ready_keys(self.tier)) == before  # sync=data: every commit survives

    @rule()
    def crash(self):
        """Drop the process's hold on the store without a clean close (no compaction, no
        flush beyond what each commit already did), as a kill would; then reopen."""
        before = set(ready_keys(self.tier))
        t = self.tier
        t._closed = True
        t._worker.shutdown(wait=True)
        t.backend.close()
        t.journal.close()
        t.store.close()
        self.tier = Tier(LAYOUT, self.cfg, device="cpu")
        assert set(ready_keys(self.tier)) == before

    @invariant()
    def bounded(self):
        assert len(self.tier.directory) <= self.tier.store.num_slots
        assert set(ready_keys(self.tier)) <= self.maybe
        for f in self.tier.store.files:
            assert os.fstat(f.fd).st_size <= self.tier.store.file_bytes


TierMachine.TestCase.settings = settings(
    max_examples=int(os.environ.get("GDSKV_SM_EXAMPLES", "25")), stateful_step_count=25,
    deadline=None, suppress_health_check=[HealthCheck.too_slow])
test_tier_state_machine = TierMachine.TestCase
