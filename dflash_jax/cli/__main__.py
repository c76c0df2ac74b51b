"""``python -m dflash_jax.cli``: the ``dflash-jax`` command."""

import sys

from dflash_jax.cli import main

sys.exit(main())
