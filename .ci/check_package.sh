#!/usr/bin/env bash
# The package as users install it (Note [What installs build and what they need] in pyproject.toml):
#   1. builds the sdist (python -m build --sdist), then the wheel from the sdist with pip (`pip wheel`: what
#      `pip install <sdist>` does with a download before it installs the wheel), so the wheel proves the sdist
#      carries everything its build reads;
#   2. checks the wheel holds swap and vmalloc, every one of their Python files, the compiled core and the
#      torch adapter's sources, and nothing else (no bench, no tests);
#   3. installs the wheel into a fresh venv (no system site-packages) holding only torch, and from a folder
#      outside the checkout imports both packages, runs `python -m swap.plan --help` and a tiny planning.
# With --all it also checks `pip install <checkout>` (pip install .) the same way.
#
# Note [One build in the package check]
# The core is compiled once. `pip install <sdist>` is `pip wheel <sdist>` followed by installing that wheel, and
# `python -m build` builds its wheel from the sdist through the same backend (setuptools, in an isolated build
# environment with the same pins): the check used to do both, compiling the same sources into the same wheel
# twice, and installed it into two venvs with torch. Half its CPU time proved nothing the other half did not.
#
#   bash .ci/check_package.sh [--all]        (make package-check; CI runs it)
#
# Environment: PYTHON (python3) makes the venvs; TORCH (torch==2.13.0, which this project's machines resolve
# to their local CPU build) is installed into each; PACKAGE_CHECK_DIR keeps the venvs and dist/ there
# (default: a temporary folder, removed at the end: in /dev/shm when it has room, since removing two torch
# installs, some 60,000 files, took minutes on this project's disk and takes a second in memory).
set -euo pipefail

ROOT=$(cd "$(dirname "$0")/.." && pwd)
PYTHON=${PYTHON:-python3}
TORCH=${TORCH:-torch==2.13.0}
FROM_CHECKOUT=0
[ "${1:-}" = "--all" ] && FROM_CHECKOUT=1
if [ -n "${PACKAGE_CHECK_DIR:-}" ]; then
  WORK=$PACKAGE_CHECK_DIR
  rm -rf "$WORK" && mkdir -p "$WORK"
else
  scratch=${TMPDIR:-/tmp}
  if [ -d /dev/shm ] && [ -w /dev/shm ] && [ "$(df -Pk /dev/shm | awk 'NR == 2 {print $4}')" -gt 4000000 ]; then
    scratch=/dev/shm
  fi
  WORK=$(mktemp -d "$scratch/vmalloc-package-check.XXXXXX")
  trap 'rm -rf "$WORK"' EXIT
fi
mkdir -p "$WORK/tmp"
export TMPDIR="$WORK/tmp"  # pip's build environments and unpacked sdists, removed with the rest
# Nothing from the checkout or the user's site may leak in: the venvs must stand alone.
unset PYTHONPATH
export PYTHONNOUSERSITE=1
# The same pins as set-up (Note [Pinned set-up] in constraints.txt), build environments included.
export PIP_CONSTRAINT="$ROOT/constraints.txt"

log() { printf '[package-check %4ds] %s\n' "$SECONDS" "$*"; }
# pip, quiet, without the lines about package indexes this machine lists but does not hold.
pip_in() { local venv=$1; shift; "$venv/bin/python" -m pip "$@" 2>&1 | { grep -v 'is ignored: it is neither' || true; }; }

fresh_venv() {  # fresh_venv DIR: a venv of its own with torch and nothing else
  "$PYTHON" -m venv "$1"
  pip_in "$1" install -q --no-compile "$TORCH"
}

# smoke VENV LABEL: run what a user runs first, from outside the checkout.
smoke() {
  local venv=$1 label=$2 outside="$WORK/outside-$2"
  mkdir -p "$outside"
  (
    cd "$outside"
    "$venv/bin/python" - "$venv" <<'EOF'
import sys
from pathlib import Path

import swap
import vmalloc
from vmalloc import torch_adapter

venv = Path(sys.argv[1]).resolve()
for module in (swap, vmalloc):
    where = Path(module.__file__).resolve()
    assert venv in where.parents, f"{module.__name__} was imported from {where}, not from the venv {venv}"
arena = vmalloc.Arena(backend="host", capacity="4MiB", chunk_size="1MiB")
arena.free(arena.malloc(1 << 20))
arena.check_invariants()
src = torch_adapter.source_dir()
assert src is not None and venv in src.resolve().parents, f"the adapter's sources are not installed: {src}"
assert torch_adapter.ninja_dir() is not None, "ninja (a dependency: the adapter's build runs it) is not found"
print(f"imports: swap and vmalloc from {venv}, a host arena served and freed 1 MiB, adapter sources in {src}")
EOF
    "$venv/bin/python" -m swap.plan --help > help.txt
    grep -q "usage: python -m swap.plan" help.txt
    "$venv/bin/python" -m swap.plan --model unet --size 64 --budget 1GiB --max-batch 4 --json plan.json > plan.txt 2>&1 \
      || { cat plan.txt; exit 1; }
    "$venv/bin/python" -c "import json; r = json.load(open('plan.json')); assert r['model'] == 'unet', r"
  )
  log "$label: imports, swap.plan --help and a planning of unet at 64x64 (batch <= 4, 1 GiB) work from $outside"
}

log "scratch folder $WORK"
"$PYTHON" -m venv "$WORK/tools"
pip_in "$WORK/tools" install -q build
log "build tool ready"
"$WORK/tools/bin/python" -m build --sdist --outdir "$WORK/dist" "$ROOT" > "$WORK/build.log" 2>&1 \
  || { tail -50 "$WORK/build.log"; exit 1; }
SDIST=$(ls "$WORK"/dist/*.tar.gz)
# The wheel from the sdist, as pip builds it (Note [One build in the package check]).
"$WORK/tools/bin/python" -m pip wheel --no-deps --wheel-dir "$WORK/dist" "$SDIST" >> "$WORK/build.log" 2>&1 \
  || { tail -50 "$WORK/build.log"; exit 1; }
WHEEL=$(ls "$WORK"/dist/*.whl)
log "built $(basename "$SDIST") and, from it with pip, $(basename "$WHEEL")"

"$WORK/tools/bin/python" - "$ROOT" "$WHEEL" "$SDIST" <<'EOF'
import sys
import tarfile
import zipfile
from pathlib import Path

root, wheel, sdist = Path(sys.argv[1]), sys.argv[2], sys.argv[3]
names = zipfile.ZipFile(wheel).namelist()
tops = {n.split("/")[0] for n in names if not n.split("/")[0].endswith(".dist-info")}
assert tops == {"swap", "vmalloc"}, f"the wheel's top-level entries are {sorted(tops)}, not swap and vmalloc"
sources = {str(p.relative_to(root)) for pkg in ("swap", "vmalloc") for p in (root / pkg).rglob("*.py")
           if "__pycache__" not in p.parts}
missing = sorted(sources - set(names))
assert not missing, f"the wheel lacks {missing} (a folder without __init__.py is not found as a package)"
needed = ["vmalloc/libvmalloc.so", "vmalloc/torch_adapter_src/adapter.cpp", "vmalloc/torch_adapter_src/core_api.h"]
assert all(n in names for n in needed), [n for n in needed if n not in names]
assert any(n.startswith("vmalloc/_C.") and n.endswith(".so") for n in names), "the wheel has no vmalloc/_C"
members = {m.split("/", 1)[1] for m in tarfile.open(sdist).getnames() if "/" in m}
for path in ("CMakeLists.txt", "setup.py", "pyproject.toml", "csrc/torch/adapter.cpp", "csrc/detail/map_budget.cpp"):
    assert path in members, f"the sdist lacks {path}"
stray = sorted(m for m in members if m.split("/")[0] in ("bench", "tests", "examples") or m.endswith(".so"))
assert not stray, f"the sdist carries {stray[:5]}"
print(f"wheel: {len(sources)} Python files of swap and vmalloc, the core, the adapter's sources, nothing else; "
      f"sdist: {len(members)} entries, CMakeLists.txt and csrc/ included")
EOF
log "contents checked"

fresh_venv "$WORK/venv-wheel"
log "fresh venv with $TORCH (venv-wheel)"
pip_in "$WORK/venv-wheel" install -q "$WHEEL"
log "wheel installed"
smoke "$WORK/venv-wheel" wheel

if [ "$FROM_CHECKOUT" = 1 ]; then
  fresh_venv "$WORK/venv-checkout"
  log "fresh venv with $TORCH (venv-checkout)"
  pip_in "$WORK/venv-checkout" install -q "$ROOT"
  log "pip install <checkout> done"
  smoke "$WORK/venv-checkout" checkout
fi
log "package check passed"
