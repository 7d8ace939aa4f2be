"""Results a handler hands the dispatcher with a condition attached.

:class:`Charged`: a result whose bytes are charged to some budget (the fs
reply budget) until the transport has sent them. The dispatcher writes the
result and releases the charge once the transport's unsent bytes show it
has left, or at once when the connection is gone. Kept apart from both the
dispatcher and the fs package, so that neither imports the other.
"""

from __future__ import annotations

from typing import Protocol

import attrs

from execserver.codec import RenderedParts


class Releasable(Protocol):
    """Something held until a reply has been sent."""

    def release(self) -> None: ...


@attrs.frozen
class Charged:
    """A result charged to a budget until the transport has sent it."""

    result: RenderedParts
    charge: Releasable
