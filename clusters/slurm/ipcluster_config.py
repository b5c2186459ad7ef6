# Engines as a Slurm batch job, for a notebook running outside Slurm (a login node, a
# JupyterHub that does not spawn into Slurm). Edit settings.py next to this file, not this.
# The engines are started as MPI ranks inside the job (see lib/ddlab/tools/slurm.py for how).
from ddlab.tools import slurm

c = get_config()  # noqa: F821 (provided by ipyparallel when it loads this file)

c.Cluster.engine_launcher_class = "ddlab.tools.slurm.SlurmEngines"
# Listen on one address that compute nodes reach, not on every interface. Messages stay
# signed with the key in the connection files (readable by you alone).
_address = slurm.controller_address(slurm.load_settings())
c.Cluster.controller_ip = _address
c.Cluster.controller_location = _address
