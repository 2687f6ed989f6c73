"""``python -m entrenar`` (and ``torchrun ... -m entrenar train RECIPE``): the same as the ``entrenar`` command."""

import sys

from entrenar.cli.main import main

sys.exit(main())
