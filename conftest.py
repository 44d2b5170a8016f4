"""The lab's fixtures (``netproxy_lab.pytest_plugin``) for every test suite; pytest reads this file
because it stands in the rootdir."""

pytest_plugins = ["netproxy_lab.pytest_plugin"]
