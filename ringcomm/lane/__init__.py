"""The small-op lane: its owner, its driver, its handle and the regions it runs over (shared memory on one host, TCP across hosts, plain memory for threads)."""
