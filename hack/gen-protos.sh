#!/usr/bin/env bash
# Generates the Python stubs of protos/jaxps/v1/*.proto into runtime/jaxps/v1/.
# Usage: hack/gen-protos.sh [OUT_ROOT]   (default: runtime; `make verify` generates into a
# temporary root and diffs it against the committed stubs).
set -euo pipefail
here=$(cd "$(dirname "$0")/.." && pwd)
out=${1:-$here/runtime}
python=${PYTHON:-$here/.venv/bin/python}
mkdir -p "$out"
cd "$here/protos"
"$python" -m grpc_tools.protoc -I . \
  --python_out="$out" --pyi_out="$out" --grpc_python_out="$out" \
  jaxps/v1/*.proto
