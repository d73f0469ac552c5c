#!/usr/bin/env bash
# `hack/timed.sh NAME COMMAND...`: runs COMMAND and prints how long it took, so `make test`
# shows where its time goes (builds, cluster start, each tier). With JAXPS_TIMES set, the line
# is also appended to that file, which `make test` prints as a summary at the end.
set -uo pipefail
name=$1
shift
start=$(date +%s%N)
"$@"
code=$?
ms=$((($(date +%s%N) - start) / 1000000))
line=$(printf '%-34s %7d.%01d s   exit %d' "$name" $((ms / 1000)) $(((ms % 1000) / 100)) "$code")
echo "==> $line"
[ -n "${JAXPS_TIMES:-}" ] && echo "$line" >>"$JAXPS_TIMES"
exit $code
