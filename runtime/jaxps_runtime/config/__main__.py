"""`python -m jaxps_runtime.config --check` (make verify) or `--write`: the optimizer table
`optimizers.json` against the installed optax (`catalog.main`)."""

import sys

from jaxps_runtime.config import catalog

sys.exit(catalog.main())
