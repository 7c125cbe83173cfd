"""Which adapter each of the device's LoRA slots holds: a running request pins its adapter's
slot; an adapter not in a slot takes a free one, else the least recently used one no running
request holds, and its weights are copied in by the first step that runs it (in the stream's
order, so an earlier step still in flight reads the slot's old adapter to its end)."""

from __future__ import annotations

from collections import OrderedDict


class LoraSlots:
    def __init__(self, num_slots: int):
        self.num_slots = num_slots
        self._slot_of: OrderedDict[str, int] = OrderedDict()  # adapter key -> slot, LRU first
        self._users: dict[int, int] = {}  # slot -> running requests that hold it
        self._loads: list[tuple[int, str]] = []  # (slot, adapter key) the next step copies in
        self.num_loads = 0  # adapters copied into a slot, ever

    def can_take(self, key: str) -> bool:
        """Whether `take(key)` would give a slot now."""
        return key in self._slot_of or self._victim() is not None

    def take(self, key: str) -> int:
        """The adapter's slot, pinned for one more running request (a load queued if needed)."""
        slot = self._slot_of.get(key)
        if slot is None:
            victim = self._victim()
            if victim is None:
                raise RuntimeError("no LoRA slot is free (check can_take first)")
            slot, evicted = victim
            if evicted is not None:
                del self._slot_of[evicted]
            self._slot_of[key] = slot
            self._loads.append((slot, key))
            self.num_loads += 1
        self._slot_of.move_to_end(key)
        self._users[slot] = self._users.get(slot, 0) + 1
        return slot

    def give_back(self, slot: int) -> None:
        """A request that held `slot` stopped running (finished or preempted)."""
        left = self._users[slot] - 1
        if left:
            self._users[slot] = left
        else:
            del self._users[slot]

    def forget(self, key: str) -> None:
        """The adapter was unloaded: its slot, when no request holds it, is free at once."""
        slot = self._slot_of.get(key)
        if slot is not None and slot not in self._users:
            del self._slot_of[key]

    def take_loads(self) -> list[tuple[int, str]]:
        """The copies the step being built must make before its forward."""
        loads, self._loads = self._loads, []
        return loads

    @property
    def resident(self) -> dict[str, int]:
        return dict(self._slot_of)

    def _victim(self) -> tuple[int, str | None] | None:
        """A slot no adapter holds, else the least recently used one no request holds, with
        the adapter it evicts."""
        held = set(self._slot_of.values())
        for slot in range(self.num_slots):
            if slot not in held:
                return slot, None
        for key, slot in self._slot_of.items():
            if slot not in self._users:
                return slot, key
        return None
