"""hashlib's BLAKE2b and SHA-256 without loading OpenSSL.

``import hashlib`` loads ``_hashlib``, OpenSSL's libcrypto: 3.6 MiB of every one-shot process's
resident set (by hand, CPython 3.11), for the two hashes netproxy uses, which CPython also builds in
(``_blake2``; ``_sha256``, ``_sha2`` from 3.12).  Same algorithms, same digests; hashlib itself only
when a build lacks them.  Modules that hash import this module as ``hashlib``: the calls read as
hashlib's (``hashlib.blake2b(...)``, ``hashlib.sha256(...)``).
"""

from __future__ import annotations

import importlib
from typing import Callable, Protocol

try:
    from _blake2 import blake2b
except ImportError:  # a build without it: hashlib's (OpenSSL's) BLAKE2b, the same digests
    from hashlib import blake2b

__all__ = ["blake2b", "sha256"]


class Digest(Protocol):
    def digest(self) -> bytes: ...

    def hexdigest(self) -> str: ...


def _sha256() -> Callable[[bytes], Digest]:
    for name in ("_sha256", "_sha2"):
        try:
            module = importlib.import_module(name)
        except ImportError:
            continue
        built_in: Callable[[bytes], Digest] = module.sha256
        return built_in
    import hashlib

    return hashlib.sha256


sha256 = _sha256()
"""``hashlib.sha256(data)``."""
