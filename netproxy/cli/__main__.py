"""``python -m netproxy.cli``: how the lab starts netproxy in a namespace (``lab.topology.netproxy_command``)."""

import sys

from netproxy.cli import main

sys.exit(main())
