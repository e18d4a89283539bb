"""``python -m actwave <command>``: see ``actwave.cli``."""
import sys

from actwave.cli import main

sys.exit(main())
