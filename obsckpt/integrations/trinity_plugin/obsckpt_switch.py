"""Trinity-RFT plugin: checkpoint and sync weights through obsckpt.

Give this file's directory to Trinity (``trinity run --plugin-dir DIR`` or
``TRINITY_PLUGIN_DIRS=DIR``), or run ``python -m obsckpt.trinity`` in place of
``trinity``. See obsckpt.integrations.trinity_install.
"""

from obsckpt.integrations.trinity_install import install

install()
