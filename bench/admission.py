"""Admission: seconds from Kueue's admission of a job to every pod Running, on the real node.

Prints one JSON object per measurement (DEVELOPERS.md format). Runs tests/e2e/admission_bench.py
(root: it starts the e2e tier's node, chart and Kueue): two jobs in a Kueue queue, each timed
from its admission to every pod Running; baseline, measured in the same run: the same job
without a queue, from its creation. `ratio` = baseline / jaxps (above 1: an admitted job starts
faster than a plain one is created and started).

    python bench/admission.py
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import results


def main() -> None:
    argparse.ArgumentParser(description=__doc__.splitlines()[0]).parse_args()
    sys.exit(results.on_the_node("admission_bench.py", {}))


if __name__ == "__main__":
    main()
