# Engines for a notebook that already runs inside a Slurm job (JupyterHub with
# batchspawner): they start as a new step of that job, sharing its CPUs (srun --overlap).
# The launcher, PMI, cores per engine, controller address and network interface come from
# clusters/slurm/settings.py; partition, account and time are the spawner's (see README.md here).
from ddlab.tools import slurm

c = get_config()  # noqa: F821 (provided by ipyparallel when it loads this file)

c.Cluster.engine_launcher_class = "ddlab.tools.slurm.AllocationEngines"
_address = slurm.controller_address(slurm.load_settings())
c.Cluster.controller_ip = _address
c.Cluster.controller_location = _address
