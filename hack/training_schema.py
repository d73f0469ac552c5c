"""`make verify`: the CRD's `spec.training` schema against the runtime's configuration
(`jaxps_runtime.config.openapi`). Exits 1 naming each field that differs.

    python hack/training_schema.py [crds/trainingjob.yaml]
"""

from __future__ import annotations

import sys
from pathlib import Path

import yaml

from jaxps_runtime.config import openapi

CRD = Path(__file__).resolve().parents[1] / "crds" / "trainingjob.yaml"


def main(argv: list[str]) -> int:
    file = Path(argv[0]) if argv else CRD
    lines = openapi.drift(openapi.training_schema(yaml.safe_load(file.read_text())))
    if not lines:
        print(f"{file.name}: spec.training matches the runtime's configuration")
        return 0
    print(f"{file}: spec.training differs from the runtime's configuration:", file=sys.stderr)
    for line in lines:
        print(f"  {line}", file=sys.stderr)
    print(
        "the runtime's dataclasses (jaxps_runtime/config) hold the defaults and rules: "
        "change the CRD to match them, or both",
        file=sys.stderr,
    )
    return 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
