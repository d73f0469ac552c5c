import sys

from jaxps_operator.cli import main

sys.exit(main())
