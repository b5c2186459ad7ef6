#!/bin/sh
# Install the course kernel, "Python (ddlab)", so JupyterHub users can pick it.
# Its notebooks start their engines inside the user's own Slurm job (profile jupyterhub),
# because the kernel sets DDLAB_PROFILE. Pass a different profile with DDLAB_PROFILE=slurm.
#
#   clusters/jupyterhub/install_kernel.sh                 # for yourself (~/.local/share/jupyter)
#   sudo clusters/jupyterhub/install_kernel.sh --prefix /usr/local   # for every user of the hub
#
# It uses the course environment made by `make setup` (or $PYTHON), which must sit on a
# file system the compute nodes see.
set -eu
here=$(cd "$(dirname "$0")" && pwd)
python=${PYTHON:-$here/../../.venv/bin/python}
if [ ! -x "$python" ]; then
    echo "No course environment at $python: run \`make setup\` first, or set PYTHON=/path/to/python." >&2
    exit 1
fi
if [ $# -eq 0 ]; then
    set -- --user
fi
exec "$python" -m ipykernel install --name ddlab --display-name "Python (ddlab)" \
    --env DDLAB_PROFILE "${DDLAB_PROFILE:-jupyterhub}" "$@"
