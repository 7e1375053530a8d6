#!/usr/bin/env bash
# Create (idempotently) the virtual environment for the hivemind baseline used by
# benchmarks/hivemind_throughput.py. It lives outside the project on purpose: hivemind's
# dependencies (grpcio, protobuf, pydantic, ...) must not leak into volunteerd's environment.
#
# Usage: benchmarks/setup_hivemind.sh [VENV_DIR]   (default: .hivemind-venv)
#
# torch is pinned and installed first so that pip finds it satisfied when it resolves
# hivemind (which asks for torch>=1.9.0) and never downloads a CUDA build.
set -euo pipefail

VENV="${1:-.hivemind-venv}"
PYTHON="${PYTHON:-python3}"
TORCH_VERSION="2.13.0"
HIVEMIND_VERSION="1.1.12"

if [[ ! -x "$VENV/bin/python" ]]; then
    "$PYTHON" -m venv "$VENV"
fi

installed() {
    "$VENV/bin/python" - "$1" "$2" <<'EOF'
import sys
from importlib.metadata import PackageNotFoundError, version

try:
    found = version(sys.argv[1])
except PackageNotFoundError:
    sys.exit(1)
sys.exit(0 if found.split("+")[0] == sys.argv[2] else 1)
EOF
}

if ! installed torch "$TORCH_VERSION"; then
    "$VENV/bin/pip" install "torch==$TORCH_VERSION"
fi
if ! installed hivemind "$HIVEMIND_VERSION"; then
    "$VENV/bin/pip" install "hivemind==$HIVEMIND_VERSION"
fi

# hivemind must not have replaced the pinned torch.
if ! installed torch "$TORCH_VERSION"; then
    echo "error: torch in $VENV is not $TORCH_VERSION after installing hivemind" >&2
    exit 1
fi
"$VENV/bin/python" -c 'import hivemind, torch; print("hivemind", hivemind.__version__, "torch", torch.__version__)'
