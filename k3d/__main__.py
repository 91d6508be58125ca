"""``python -m k3d``: the ``k3d`` command."""

import sys

from k3d.commands.cli import main

sys.exit(main())
