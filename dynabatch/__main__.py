"""``python -m dynabatch`` is the ``dynabatch`` command."""

import sys

from dynabatch.cli import main

sys.exit(main())
