#!/usr/bin/env bash
# Set up .venv (idempotent) and run the main job: the data-pipeline report on the
# built-in offline mixture. Extra args go to `dynabatch data-report`.
source "$(dirname "$0")/_setup.sh"
dynabatch data-report --mixture data/flan_mini.yaml "$@"
