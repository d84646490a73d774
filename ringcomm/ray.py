"""``ringcomm.ray``: run a job on a Ray cluster (the code lives in :mod:`ringcomm.launch.ray`)."""

from .launch.ray import RayExecutor, RaySettings, plan_ranks

__all__ = ["RayExecutor", "RaySettings", "plan_ranks"]
