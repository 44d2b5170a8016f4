"""What every source of services and endpoints offers ``netproxy run``."""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:  # the tracker imports netproxy.source.convert: no import cycle at run time
    from netproxy.core.tracker import ChangeTracker


class Source(Protocol):
    """Feeds a tracker from the files (netproxy/source/files.py) or the Kubernetes API (kube.py):
    ``start`` begins delivering into ``tracker`` (in the source's own threads), ``stop`` ends it."""

    def start(self, tracker: ChangeTracker) -> None: ...

    def stop(self) -> None: ...
