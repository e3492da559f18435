"""``python -m schedspec``: the command line."""

import sys

from schedspec.cli.main import main

sys.exit(main())
