#!/usr/bin/env bash
# Mutation testing of spec/ and impl/ with mutmut 3 (docs/bugzoo.md, "Mutation testing").
#
#   tests/bugzoo/run_mutmut.sh                 # every mutant of spec/ and impl/
#   tests/bugzoo/run_mutmut.sh 'spec.rules*'   # only these mutants (mutmut name globs)
#
# mutmut runs in a scratch copy of the working tree ($MUTMUT_WORKDIR, default
# /tmp/schedspec-mutmut), so the repository gets no mutants/ directory and its
# pyproject.toml no [tool.mutmut] table: the table below is appended to the
# copy's. Results stay in the copy: `cd $MUTMUT_WORKDIR && mutmut results`,
# `mutmut show NAME`; the summary is printed at the end. Quote a score only from
# a fresh full run (a new MUTMUT_WORKDIR): with name globs, mutmut re-tests only
# the named mutants and keeps stale results for the rest of a changed function.
#
# The test command for each mutant is the fast selection: tests/test_spec.py (the
# spec's scenario tests), tests/test_spec_mutants.py (scenario tests written for
# survivors of earlier runs, and a short `schedspec check --against impl` run:
# spec and impl in lockstep, every invariant) and tests/test_impl_clone.py (the
# impl's clone(), which the model checker relies on), stopping at the first
# failure. mutmut runs, for each mutant, only the tests that execute the mutated
# function.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
WORK="${MUTMUT_WORKDIR:-/tmp/schedspec-mutmut}"
PY="${PYTHON:-$ROOT/.venv/bin/python}"
[ -x "$PY" ] || PY="$(command -v python)"
MUTMUT="$(dirname "$PY")/mutmut"
CHILDREN="${MUTMUT_CHILDREN:-2}"

mkdir -p "$WORK"
# Sync the working tree (tracked and untracked-but-not-ignored files), keeping
# mutmut's own state (mutants/) so an interrupted run resumes.
(cd "$ROOT" && git ls-files -co --exclude-standard -z | tar --null -T - -cf -) | tar -xf - -C "$WORK"
cat >> "$WORK/pyproject.toml" <<'EOF'

[tool.mutmut]
source_paths = ["spec", "impl"]
do_not_mutate = ["impl/bench.py"]
also_copy = ["harness", "invariants"]
pytest_add_cli_args_test_selection = ["tests/test_spec.py", "tests/test_spec_mutants.py", "tests/test_impl_clone.py"]
pytest_add_cli_args = ["-p", "no:cacheprovider", "-p", "no:xdist", "-W", "ignore"]
EOF
cd "$WORK"
start=$(date +%s)
"$MUTMUT" run --max-children "$CHILDREN" "$@" || true
"$MUTMUT" export-cicd-stats >/dev/null
echo "mutmut run took $(( $(date +%s) - start )) s"
cat mutants/mutmut-cicd-stats.json
