#!/usr/bin/env bash
# Run some tests against one mutmut mutant, outside mutmut: for writing the
# test that kills a survivor.
#
#   tools/mutation/try_mutant.sh WORKDIR MUTANT_NAME tests/spec/test_x.py [pytest args...]
#
# WORKDIR is a mutmut work directory (tools/mutation/run_mutmut.sh) whose
# mutants were generated from the same spec/ and impl/ as this tree. The
# mutant's diff (`mutmut show`) is applied to a scratch copy of this tree
# (spec/ or impl/; tools/mutation/apply_diff.py places it) and pytest runs
# there. Exit status: pytest's (non-zero: the tests kill the mutant); 3 if
# the diff does not apply.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
WORK="$1"; NAME="$2"; shift 2
PY="${PYTHON:-$ROOT/.venv/bin/python}"
SCRATCH="$(mktemp -d /tmp/try-mutant.XXXXXX)"
trap 'rm -rf "$SCRATCH"' EXIT
(cd "$ROOT" && git ls-files -co --exclude-standard -z | tar --null -T - -cf -) | tar -xf - -C "$SCRATCH"
(cd "$WORK" && "$(dirname "$PY")/mutmut" show "$NAME") | "$PY" "$ROOT/tools/mutation/apply_diff.py" "$SCRATCH" \
  || { echo "diff of $NAME does not apply" >&2; exit 3; }
cd "$SCRATCH" && "$PY" -m pytest -q -x -p no:cacheprovider -p no:randomly "$@"
