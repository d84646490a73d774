"""Former home of the ``torch.backends`` entry point, kept for installs whose metadata still names it.

The entry point is now :mod:`ringcomm_torch_plugin` (``ringcomm_torch_plugin:load``): a
package outside ``ringcomm``, so that torch can import it even where ringcomm's own
dependencies are broken.  Reinstalling ringcomm points the entry point there.
"""

from __future__ import annotations

from ringcomm_torch_plugin import NAME, load

__all__ = ["NAME", "load"]
