"""``python -m search_demo run|assets|report``: the demo's driver (``search_demo.driver``)."""

import sys

from search_demo.driver import main

sys.exit(main())
