#!/usr/bin/env bash
# Make LINK (.venv or .venv-vllm) a symlink to a virtual environment kept in a cache outside the
# checkout, named by what is installed in it, and run BUILD there only when that cache entry is new:
#     scripts/cached-venv.sh LINK KEY BUILD...      (BUILD gets the venv's path as its last argument)
# A second clone on the same machine (CI's fresh clone, a worktree) then installs nothing, the way
# pip's own cache spares it the downloads. The cache is $FLEXPIPE_VENV_CACHE, default
# ~/.cache/flexpipe; KEY names the pins (requirements.txt's checksum, vLLM's version), so a change
# of pins builds a new entry. A LINK that is a real directory (a checkout from before this script)
# is used as it is. Builds of one entry are serialised with flock; a failed build is removed.
set -euo pipefail
link="$1"; key="$2"; shift 2
if [ -d "$link" ] && [ ! -L "$link" ]; then
  exec "$@" "$link"
fi
cache="${FLEXPIPE_VENV_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/flexpipe}"
mkdir -p "$cache"
entry="$cache/$key"
(
  flock 9
  if [ ! -e "$entry/.complete" ]; then
    rm -rf "$entry"
    "$@" "$entry" || { rm -rf "$entry"; exit 1; }
    touch "$entry/.complete"
  fi
) 9>"$entry.lock"
ln -sfn "$entry" "$link"
