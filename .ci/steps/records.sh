#!/usr/bin/env bash
# CI step (in .ci/run's main environment): the training records the README quotes, re-run in full. Every step
# of the main job (200) and of the three lookup runs (3 x 200) on the embedded model, compared with
# docs/records/main_job.json and lookup_turn_credit.json: rewards exactly, losses to fp32 rounding. On a
# difference it fails naming the first step and the one command that regenerates records and README spans:
# python tools/records/records.py
set -euo pipefail
cd "$(dirname "$0")/../.."
start=$(date +%s)
python tools/records/records.py --check
echo "records step finished in $(( $(date +%s) - start )) s"
