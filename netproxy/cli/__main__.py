"""``python -m netproxy.cli``: the lab and deploy scripts start netproxy this way (kept since cli.py was one module)."""

import sys

from netproxy.cli import main

sys.exit(main())
