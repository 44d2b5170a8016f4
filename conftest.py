"""The lab's fixtures (``netproxy_lab.pytest_plugin``) for every test suite, the fault suite's
figures (``tests.faults.figures``: printed in the summary, from xdist's workers too) and the
hostile-input floor judged over the whole run (``tests.unit.hostile_floor``); pytest reads this
file because it stands in the rootdir."""

pytest_plugins = ["netproxy_lab.pytest_plugin", "tests.faults.figures", "tests.unit.hostile_floor"]
