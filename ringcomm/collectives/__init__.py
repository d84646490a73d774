"""How a negotiated op's bytes move: the executor, the ring and tree algorithms over a link, the hierarchical and shared-memory allreduce."""
