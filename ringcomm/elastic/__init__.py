"""Elastic training: jobs that survive losing workers and grow when hosts appear.

- :mod:`.plan` -- pure membership logic (rank assignment, blacklisting).
- :mod:`.discovery` -- the host discovery script.
- :mod:`.driver` -- the launcher side (``ringcomm-run --host-discovery-script``).
- :mod:`.worker` -- the worker side: each ``init()`` asks the driver for this process's place.
- :mod:`.state` -- ``State``, ``ObjectState`` and the ``run`` decorator (framework-agnostic;
  ``ringcomm_torch.elastic`` adds ``TorchState`` and ``ElasticSampler``).
"""

from __future__ import annotations
