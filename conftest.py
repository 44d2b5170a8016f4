"""The lab's fixtures (``netproxy.lab.pytest_plugin``) for every test suite; pytest reads this file
because it stands in the rootdir."""

pytest_plugins = ["netproxy.lab.pytest_plugin"]
