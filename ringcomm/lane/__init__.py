"""The small-op lane: its driver and the two regions it runs over, shared memory on one host and TCP across hosts."""
