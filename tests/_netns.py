"""Two "hosts" on one machine for the multi-host tests: see :mod:`ringcomm.bench._netns`.

The ``hosts`` fixture (two fresh namespaces, or a skip naming what is missing) is in conftest.py.
"""

from ringcomm.bench._netns import TwoHosts, unavailable_reason

__all__ = ["TwoHosts", "unavailable_reason"]
