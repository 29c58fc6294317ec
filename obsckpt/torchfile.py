"""``obsckpt.torchfile`` is :mod:`obsckpt.store.torchfile` (the storage layer's); this path stays."""

import sys

from obsckpt.store import torchfile as _module

sys.modules[__name__] = _module
