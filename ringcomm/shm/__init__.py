"""Shared memory on one host: the slot rings, the futex and the barrier that the lane and the shared-memory allreduce build on."""
