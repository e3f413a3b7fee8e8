"""The block index: keys to tier slots, pins, eviction policy, free-slot bookkeeping. Touches no bytes."""
