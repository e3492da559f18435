#!/usr/bin/env bash
# Mutation testing of spec/ and impl/ with mutmut 3 (docs/bugzoo.md, "Mutation testing").
#
#   tools/mutation/run_mutmut.sh                           # every mutant of spec/ and impl/
#   tools/mutation/run_mutmut.sh 'schedspec.spec.rules*'   # only these mutants (mutmut name globs)
#
# mutmut runs in a scratch copy of the working tree ($MUTMUT_WORKDIR, default
# /tmp/schedspec-mutmut), so the repository gets no mutants/ directory and its
# pyproject.toml no mutmut table: the table below is appended to the copy's.
# Results stay in the copy: `cd $MUTMUT_WORKDIR && mutmut results`,
# `mutmut show NAME`; tools/mutation/mutation_report.py sums them up. Quote a
# score only from a fresh full run (a new MUTMUT_WORKDIR): with name globs,
# mutmut re-tests only the named mutants and keeps stale results for the rest
# of a changed function.
#
# What is mutated: schedspec/spec and schedspec/impl, the symlinks to spec/ and
# impl/ (mutmut walks a symlinked folder as a folder). mutmut names a mutant by
# the path it mutated, so the names are those of the modules the tests import:
# schedspec.spec.rules.x_choose_victim__mutmut_3,
# schedspec.impl.scheduler.xǁImplSchedulerǁschedule__mutmut_12. The copy under
# mutants/ gets schedspec/ with its symlinks followed (real folders that hold the
# mutated files), tests/, vectors/, docs/, and plain copies of spec/, impl/ and
# invariants/ for tests that read source files by path (never imported: the
# tests import schedspec.*).
#
# The test command for each mutant is the fast selection below, stopping at
# the first failure (vLLM's tests deselected, and the CrossHair contract run,
# which would check every mutant copy of a function): the spec's scenario,
# rule, message, clone and coverage tests; impl beside the spec, its
# structures, clone(), gates, connector and KV groups; every vector replayed
# in lockstep; a preemption-heavy lockstep run and a short gate run. mutmut
# runs, for each mutant, only the tests that execute the mutated function,
# fastest first. docs/bugzoo.md, "Sampling", says how to score a seeded
# sample of the mutants.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
WORK="${MUTMUT_WORKDIR:-/tmp/schedspec-mutmut}"
PY="${PYTHON:-$ROOT/.venv/bin/python}"
[ -x "$PY" ] || PY="$(command -v python)"
MUTMUT="$(dirname "$PY")/mutmut"
CHILDREN="${MUTMUT_CHILDREN:-2}"

mkdir -p "$WORK"
# Sync the working tree (tracked and untracked-but-not-ignored files, symlinks
# as symlinks), keeping mutmut's own state (mutants/) so an interrupted run resumes.
(cd "$ROOT" && git ls-files -co --exclude-standard -z | tar --null -T - -cf -) | tar -xf - -C "$WORK"
cat >> "$WORK/pyproject.toml" <<'EOF'

[tool.mutmut]
source_paths = ["schedspec/spec", "schedspec/impl"]
also_copy = ["schedspec", "spec", "impl", "invariants", "vectors", "docs"]
pytest_add_cli_args_test_selection = [
    "tests/spec/test_scheduler.py", "tests/spec/test_rules.py", "tests/spec/test_config.py",
    "tests/spec/test_interface.py", "tests/spec/test_protocol.py", "tests/spec/test_async_spec.py",
    "tests/spec/test_gates.py", "tests/spec/test_gates_interface.py", "tests/spec/test_kv_groups.py",
    "tests/spec/test_connector.py", "tests/spec/test_from_dict.py", "tests/spec/test_group_validation.py",
    "tests/spec/test_coverage_text.py", "tests/spec/test_clone_independence.py",
    "tests/impl/test_twins.py", "tests/impl/test_queues.py", "tests/impl/test_structures.py",
    "tests/impl/test_clone.py", "tests/vectors/test_vectors.py", "tests/impl/test_gate.py",
    "tests/impl/test_gates.py", "tests/impl/test_connector.py", "tests/impl/test_kv_groups.py",
    "tests/impl/test_connector_lockstep.py", "tests/check/test_rule_coverage.py",
]
pytest_add_cli_args = ["-p", "no:cacheprovider", "-p", "no:xdist", "-W", "ignore", "-m", "not vllm",
                       "--deselect", "tests/spec/test_kv_groups.py::test_kv_groups_contracts_hold"]
EOF
cd "$WORK"
start=$(date +%s)
"$MUTMUT" run --max-children "$CHILDREN" "$@" || true
"$MUTMUT" export-cicd-stats >/dev/null
echo "mutmut run took $(( $(date +%s) - start )) s"
cat mutants/mutmut-cicd-stats.json
