"""Random offload / restore / delete / corrupt sequences against a model that keeps every byte.

The model predicts every outcome exactly, LRU eviction included, and the whole pool
after every step: a restore writes exactly its slots with exactly the offloaded bytes
(a slot reported DATA_LOSS holds undefined bytes; every other byte is checked).
"""

import shutil
import tempfile
from collections import OrderedDict

import torch
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

import kvxfer.core.slots
import kvxfer.core.validate
import kvxfer.index.eviction
import kvxfer.index.keytable
from kvxfer.core.records import Outcome
from kvxfer.geometry.layout import PRESETS, KVSpec
from kvxfer.memory.pool import Pool
from kvxfer.serving.pool_manager import PoolManager
from tests.helpers import read_block, write_block

SPEC = KVSpec(num_layers=3, num_blocks=10, block_size=2, num_kv_heads=2, head_size=4, dtype=torch.bfloat16)
CAPACITY = 4
KEYS = [f"key-{i}".encode() for i in range(8)]
NS = "model"

# The C modules' users, and the name each knows its module by (None: the Python twins run).
NATIVE_USERS = ((kvxfer.core.validate, "FAST"), (kvxfer.core.slots, "FAST"), (kvxfer.index.keytable, "TABLES"),
                (kvxfer.index.eviction, "USE_ORDER"))
slots_st = st.lists(st.integers(1, SPEC.num_blocks - 1), min_size=1, max_size=5, unique=True)


class StoreMachine(RuleBasedStateMachine):
    layout_name = "BLHNC"

    @initialize()
    def setup(self):
        self.dir = tempfile.mkdtemp(prefix="kvxfer-test-", dir="/dev/shm")
        self.pool = Pool.create("model", SPEC, PRESETS[self.layout_name], shm_dir=self.dir)
        self.m = PoolManager(self.pool, CAPACITY)
        self.layout = self.pool.layout
        self.stored: OrderedDict[bytes, torch.Tensor] = OrderedDict()  # the model, LRU order
        self.corrupted: set[bytes] = set()
        self.expected_pool = self.pool.storage.clone()
        self.counter = 0

    def teardown(self):
        if hasattr(self, "pool"):
            self.pool.close()
            shutil.rmtree(self.dir, ignore_errors=True)

    @rule(slots=slots_st)
    def engine_writes(self, slots):
        for slot in slots:
            self.counter += 1
            data = torch.randint(0, 256, (SPEC.block_bytes,), dtype=torch.uint8,
                                 generator=torch.Generator().manual_seed(self.counter))
            write_block(self.pool.storage, self.layout, slot, data)
            write_block(self.expected_pool, self.layout, slot, data)

    @rule(slots=slots_st, data=st.data())
    def offload(self, slots, data):
        keys = data.draw(st.lists(st.sampled_from(KEYS), min_size=len(slots), max_size=len(slots), unique=True))
        outcomes = self.m.offload(NS, list(zip(slots, keys))).outcomes
        expected = []
        new = [k for k in keys if k not in self.stored]
        for k in keys:
            if k in self.stored:
                self.stored.move_to_end(k)
        protected = set(keys)
        while len(self.stored) + len(new) > CAPACITY:
            victim = next((k for k in self.stored if k not in protected), None)
            if victim is None:
                break
            del self.stored[victim]
        room = CAPACITY - len(self.stored)
        for k in keys:
            if k in self.stored:
                expected.append(Outcome.ALREADY_PRESENT)
            elif room > 0:
                room -= 1
                expected.append(Outcome.DONE)
            else:
                expected.append(Outcome.RESOURCE_EXHAUSTED)
        for slot, k, o in zip(slots, keys, expected):
            if o is Outcome.DONE:
                self.stored[k] = read_block(self.expected_pool, self.layout, slot)
                self.corrupted.discard(k)
        assert outcomes == expected

    @rule(slots=slots_st, data=st.data())
    def restore(self, slots, data):
        keys = data.draw(st.lists(st.sampled_from(KEYS), min_size=len(slots), max_size=len(slots), unique=True))
        outcomes = self.m.restore(NS, list(zip(keys, slots))).outcomes
        expected = []
        for slot, k in zip(slots, keys):
            if k not in self.stored:
                expected.append(Outcome.NOT_FOUND)
            elif k in self.corrupted:
                expected.append(Outcome.DATA_LOSS)
                del self.stored[k]
                self.corrupted.discard(k)
                # A failed block's slot holds undefined bytes (the engine never reads it).
                write_block(self.expected_pool, self.layout, slot, read_block(self.pool.storage, self.layout, slot))
            else:
                expected.append(Outcome.DONE)
                self.stored.move_to_end(k)
                write_block(self.expected_pool, self.layout, slot, self.stored[k])
        assert outcomes == expected

    @rule(keys=st.lists(st.sampled_from(KEYS), max_size=4))
    def delete(self, keys):
        self.m.delete(NS, keys)
        for k in keys:
            self.stored.pop(k, None)
            self.corrupted.discard(k)

    @precondition(lambda self: len(self.stored) > len(self.corrupted))
    @rule(data=st.data())
    def corrupt(self, data):
        k = data.draw(st.sampled_from([k for k in self.stored if k not in self.corrupted]))
        slot = self.m.group.index.locate(NS, k)
        byte = data.draw(st.integers(0, SPEC.block_bytes - 1))
        self.m.host.buffer[slot][byte] ^= 1 << data.draw(st.integers(0, 7))
        self.corrupted.add(k)

    @invariant()
    def pool_and_index_match_the_model(self):
        if not hasattr(self, "pool"):
            return
        assert torch.equal(self.pool.storage, self.expected_pool)
        lookup = self.m.lookup(NS, KEYS)
        assert [t is not None for t in lookup.tiers] == [k in self.stored for k in KEYS]
        stats = self.m.group.index.stats()
        assert stats.pinned == 0 and stats.used == len(self.stored) <= CAPACITY
        # The counters Stats reads in O(1) equal a count over the whole index.
        index = self.m.group.index
        assert (stats.ready, stats.pinned) == (int((index._state == 2).sum()), int(index._pins.astype(bool).sum()))


class LayerMajorStoreMachine(StoreMachine):
    layout_name = "LBHNC"


class PythonPassesStoreMachine(StoreMachine):
    """The same model with the index and validation on their Python twins alone (as where
    kvxfer's C modules are not built)."""

    @initialize()
    def setup(self):
        self.saved = {(m, name): getattr(m, name) for m, name in NATIVE_USERS}
        for module, name in NATIVE_USERS:
            setattr(module, name, None)
        super().setup()

    def teardown(self):
        for (module, name), native in getattr(self, "saved", {}).items():
            setattr(module, name, native)
        super().teardown()


settings_ = settings(max_examples=40, stateful_step_count=25, deadline=None)
TestBlockMajorStore = StoreMachine.TestCase
TestBlockMajorStore.settings = settings_
TestLayerMajorStore = LayerMajorStoreMachine.TestCase
TestLayerMajorStore.settings = settings_
TestStoreOnPythonPasses = PythonPassesStoreMachine.TestCase
TestStoreOnPythonPasses.settings = settings_
