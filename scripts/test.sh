#!/usr/bin/env bash
# Set up .venv (idempotent) and run the test suite. Extra args go to pytest.
source "$(dirname "$0")/_setup.sh"
python -m pytest -q "$@"
