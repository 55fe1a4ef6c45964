"""``comm_codec.lossy``: the lossy checkpoint modes, :mod:`comm_codec.checkpoint.lossy`.

Kept as a public name: ``from comm_codec import lossy`` and ``import comm_codec.lossy``
give the very module :mod:`comm_codec.checkpoint.lossy` (one object, so its functions,
constants and cache are shared, not copied).
"""

import sys

from .checkpoint import lossy as _lossy

sys.modules[__name__] = _lossy
