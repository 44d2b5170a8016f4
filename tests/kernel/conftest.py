"""Kernel tests: real netfilter inside throwaway network namespaces (root; see harness.py)."""

from harness import (  # noqa: F401  (fixtures and the parametrisation hook, re-exported for pytest)
    bare_sandbox,
    combo,
    kernel_env,
    proxy,
    pytest_generate_tests,
    sandbox,
)
