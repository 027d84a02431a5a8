"""``python -m slideformer``: the ``slideformer`` command."""
import sys

from slideformer.cli import main

sys.exit(main())
