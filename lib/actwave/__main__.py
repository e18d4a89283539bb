"""``python -m actwave <command>`` = the ``actwave`` command: see ``actwave.tools.cli``."""
import sys

from actwave.tools.cli import main

sys.exit(main())
