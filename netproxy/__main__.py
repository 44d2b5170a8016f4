import sys

from netproxy.cli import main

sys.exit(main())
