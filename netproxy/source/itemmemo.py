"""Objects whose bytes did not change since the last read are not decoded or converted again.

``netproxy run --source`` reads a replaced file whole; at 10k services its items took ~0.75 s to
decode and convert again (docs/performance.md) although a change is usually one or two of them.
The previous read's conversions are kept by a digest of each item's exact bytes (a JSON ``List``'s
items, as msgspec hands them over undecoded): the same bytes are the same object, so its
conversion — model objects, which are immutable, or the refusal that names its field — is reused
as it was.  A digest (16 bytes) is kept, not the bytes: the memo costs ~50 bytes an item beside the
model it points into, which the tracker holds anyway.  Only the previous read's items are kept
(``rotate``): objects that left the file are forgotten at the next read.

What is memoised is one object's conversion, never the assembly of a load (duplicate names,
legacy Endpoints standing in for slices, the node's object): that runs over every object, reused or
not, so a reused object is judged against the others exactly as a fresh one.
"""

from __future__ import annotations

from typing import Dict, Generic, Optional, TypeVar

from netproxy.core import hashes as hashlib  # hashlib's hashes without OpenSSL (core/hashes.py)

T = TypeVar("T")


def digest(raw: bytes | memoryview) -> bytes:
    """16 bytes of BLAKE2b: collisions are out of reach, and it hashes ~1 GB/s."""
    return hashlib.blake2b(raw, digest_size=16).digest()


class ItemMemo(Generic[T]):
    """One file's conversions by item digest: the previous read's, and the current read's so far."""

    def __init__(self) -> None:
        self._old: Dict[bytes, T] = {}
        self._new: Dict[bytes, T] = {}
        self.hits = 0
        self.misses = 0

    def get(self, key: bytes) -> Optional[T]:
        found = self._old.get(key)
        if found is None:
            self.misses += 1
            return None
        self.hits += 1
        self._new[key] = found
        return found

    def put(self, key: bytes, value: T) -> None:
        self._new[key] = value

    def rotate(self) -> None:
        """The read is complete: its items are the next read's reference; the rest is forgotten."""
        self._old, self._new = self._new, {}

    def discard(self) -> None:
        """The read failed: keep the previous reference as it was."""
        self._new = {}
