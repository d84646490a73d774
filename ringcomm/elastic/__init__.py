"""Elastic training on the workers' side: jobs that survive losing workers and grow when hosts appear.

- :mod:`.plan` -- pure membership logic (rank assignment, blacklisting).
- :mod:`.worker` -- the worker side: each ``init()`` asks the driver for this process's place.
- :mod:`.state` -- ``State``, ``ObjectState`` and the ``run`` decorator (framework-agnostic;
  ``ringcomm_torch.elastic`` adds ``TorchState`` and ``ElasticSampler``).

The launcher side (the driver, the worker starter, the host discovery script) lives in
:mod:`ringcomm.launch`: ``elastic_driver``, ``elastic_starter``, ``elastic_discovery``.
"""

from __future__ import annotations
