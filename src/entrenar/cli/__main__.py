"""``python -m entrenar.cli``: the same as the ``entrenar`` command."""

import sys

from entrenar.cli.main import main

sys.exit(main())
