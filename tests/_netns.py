"""Two "hosts" on one machine for the multi-host tests: see :mod:`ringcomm.bench._netns`."""

from ringcomm.bench._netns import TwoHosts, unavailable_reason

__all__ = ["TwoHosts", "unavailable_reason"]
