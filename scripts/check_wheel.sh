#!/usr/bin/env bash
# The wheel is complete: build it, install it alone into a fresh virtual environment, and from
# outside the repository list the presets and dry-run every one of them (the presets are package
# data; a wheel without them fails here, not on a user's machine).
#
#   bash scripts/check_wheel.sh [PYTHON]
#
# PYTHON (default: $PYTHON, else python3) must have loongforge's dependencies installed; the fresh
# environment borrows them through a .pth file, so nothing is downloaded and only loongforge itself
# comes from the wheel. Writes only to a temporary folder, removed on exit.
set -euo pipefail
REPO="$(cd "$(dirname "$0")/.." && pwd)"
PY="${1:-${PYTHON:-python3}}"
WORK="$(mktemp -d)"
trap 'rm -rf "$WORK"' EXIT

# Build with the interpreter's own setuptools when it has one (offline), else in pip's isolated build env.
isolation=()
# (pyproject's build-system wants setuptools >= 77, for the PEP 639 license string).
if "$PY" -c 'import setuptools, sys; sys.exit(int(setuptools.__version__.split(".")[0]) < 77)' 2> /dev/null; then
  isolation=(--no-build-isolation)
fi
# From a copy of what the wheel is built from, so the build leaves nothing in the checkout.
mkdir "$WORK/src"
cp -r "$REPO/pyproject.toml" "$REPO/README.md" "$REPO/loongforge" "$WORK/src/"
"$PY" -m pip wheel --quiet --no-deps "${isolation[@]}" -w "$WORK/dist" "$WORK/src"
wheel=("$WORK"/dist/loongforge-*.whl)
echo "built ${wheel[0]##*/}"

"$PY" -m venv "$WORK/venv"
VPY="$WORK/venv/bin/python"
deps="$("$PY" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
site="$("$VPY" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
# Appended after the venv's own site-packages, so the wheel's loongforge wins over any other copy.
echo "$deps" > "$site/zz_loongforge_deps.pth"
"$VPY" -m pip install --quiet --no-index --no-deps "${wheel[0]}"

cd /
run() { env -u PYTHONPATH -u LOONGFORGE_PRESETS OMP_NUM_THREADS=1 "$@"; }
where="$(run "$VPY" -c 'import loongforge.config.presets as p; print(p.presets_dir())')"
case "$where" in
  "$site"/*) ;;
  *) echo "FAIL: presets resolve to $where, not inside the installed wheel ($site)" >&2; exit 1 ;;
esac
run "$WORK/venv/bin/loongforge" train --list-presets
# Every preset dry-runs through the installed command's own app, in one process: a process per preset
# paid ~1.3 s of imports 54 times (most of this script's time) for the same proof.
run "$VPY" - "$WORK/dry_run.txt" <<'PY'
import contextlib
import sys

from loongforge.cli.app import app  # what the installed `loongforge` script runs
from loongforge.config.presets import list_preset_names

names = list_preset_names()
if not names:
    sys.exit("FAIL: the installed wheel has no presets")
for name in names:
    with open(sys.argv[1], "w") as out, contextlib.redirect_stdout(out), contextlib.redirect_stderr(out):
        try:
            app(["train", "--preset", name, "--dry-run"], prog_name="loongforge")
            code = 0
        except SystemExit as exc:
            code = exc.code or 0
    if code:
        sys.stderr.write(open(sys.argv[1]).read())
        sys.exit(f"FAIL: --preset {name} --dry-run (exit {code})")
    print(f"ok: loongforge train --preset {name} --dry-run")
print(f"wheel check passed: {len(names)} presets dry-run from the installed wheel")
PY
