"""``obsckpt.commit`` is :mod:`obsckpt.store.commit` (the storage layer's); this path stays."""

import sys

from obsckpt.store import commit as _module

sys.modules[__name__] = _module
