"""The pure core: every decision of the runtime, with no I/O, no threads and no clock.

- :mod:`~ringcomm.core.wire`: the codec of control and data-plane messages (both halves);
- :mod:`~ringcomm.core.session`: one rank's in-flight ops, caches, op counts and process sets;
- :mod:`~ringcomm.core.service`: rank 0's negotiation (controller, small ops, cache recording);
- :mod:`~ringcomm.core.controller`, :mod:`~ringcomm.core.coordinator`: the order of every set's ops;
- :mod:`~ringcomm.core.fusion`, :mod:`~ringcomm.core.ring`, :mod:`~ringcomm.core.cache`,
  :mod:`~ringcomm.core.ops`: fusion plans, ring schedules, the response cache, reduce ops;
- :mod:`~ringcomm.core.process_sets`: the ``ProcessSet`` objects users build and register.

Nothing here imports zmq, socket, select, threading, time, os or torch (a test checks it):
the runtime around it (``ringcomm.engine`` and the transports) feeds it events and does its I/O.
"""
