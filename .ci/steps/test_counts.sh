#!/usr/bin/env bash
# CI step: the README's test counts (docs/records/tests.json) are those of this run's quick tier and full suite
# (.ci/tests-quick.json, .ci/tests.json, written by the two README test commands earlier in .ci/run). When they
# differ it fails and says the one command that refreshes the record and the README's span from this run.
set -euo pipefail
cd "$(dirname "$0")/../.."
python3 tools/records/tests_record.py --check .ci/tests-quick.json .ci/tests.json
