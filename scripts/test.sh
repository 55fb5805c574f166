#!/usr/bin/env bash
# The test command: set up everything the tests need, then run them.
# CI runs the default selection (fast tests plus a representative slow subset marked `ci`).
# Pass pytest arguments through, e.g. `scripts/test.sh -m slow` for all real-model tests.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh --docker --browser --models qwen2.5-coder-0.5b qwen2.5-coder-1.5b smollm2-135m --benchmarks bfcl toolsandbox
args=("$@"); [ ${#args[@]} -gt 0 ] || args=(-m "not slow or ci")
set +e
.venv/bin/python -m pytest "${args[@]}"
rc=$?
set -e
if [ $rc -eq 5 ]; then echo "pytest collected no tests: failing" >&2; exit 1; fi
exit $rc
