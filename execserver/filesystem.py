"""The ``fs/*`` methods: kept importable under their old name.

The code lives in the :mod:`execserver.fs` package, one concept per module.
"""

import os  # noqa: F401 (tests patch ``execserver.filesystem.os.*``: the one os module)

from execserver.fs import *  # noqa: F403
from execserver.fs import __all__ as __all__  # noqa: PLC0414 (re-exported)
