"""``obsckpt.loading`` is :mod:`obsckpt.store.loading` (the storage layer's); this path stays."""

import sys

from obsckpt.store import loading as _module

sys.modules[__name__] = _module
