#!/usr/bin/env bash
# Prints the path of a Python 3.12 interpreter: `python3.12` on the PATH, or else the newest 3.12
# that pyenv has installed (pyenv's shim refuses a bare `python3.12` unless that version is
# selected). Exits 1 with a one-line message when there is none.
set -euo pipefail
is_312() { "$@" -c 'import sys; sys.exit(sys.version_info[:2] != (3, 12))' 2>/dev/null; }
if is_312 python3.12; then
  python3.12 -c 'import sys; print(sys.executable)'
  exit 0
fi
if command -v pyenv >/dev/null 2>&1; then
  version="$(pyenv versions --bare 2>/dev/null | grep -E '^3\.12(\.[0-9]+)?$' | sort -V | tail -n 1 || true)"
  if [ -n "$version" ] && is_312 env PYENV_VERSION="$version" python3.12; then
    PYENV_VERSION="$version" python3.12 -c 'import sys; print(sys.executable)'
    exit 0
  fi
fi
echo "no Python 3.12 found: install it (e.g. 'pyenv install 3.12' or your system's python3.12)" >&2
exit 1
