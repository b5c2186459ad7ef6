# Example JupyterHub configuration for teaching ddlab on a Slurm cluster: each student's
# notebook server runs as a Slurm job (batchspawner) sized for the lab's engines, and the
# course kernel (install_kernel.sh) starts the engines inside that job.
#
# Merge the parts you need into your hub's jupyterhub_config.py. The hub's environment needs
# `pip install -r clusters/jupyterhub/requirements-hub.txt` and configurable-http-proxy (npm);
# the course environment needs the same requirements (the job runs batchspawner-singleuser
# and jupyterhub-singleuser from it). Adjust the settings marked SITE.
# tests/browser/test_jupyterhub.py runs this file against a real Slurm, changing only ports,
# paths and the authenticator.
import batchspawner  # noqa: F401 (registers the API through which the job tells the hub its port)

c = get_config()  # noqa: F821 (provided by JupyterHub)

# SITE: the public URL (put TLS in front, or configure c.JupyterHub.ssl_cert / ssl_key).
c.JupyterHub.bind_url = "http://:8000"
# The notebook servers run on compute nodes and call the hub's API: it must listen where
# they reach it. SITE: set hub_connect_ip to this host's address on the cluster network if
# its host name does not resolve to that address on the compute nodes.
c.JupyterHub.hub_ip = "0.0.0.0"
c.JupyterHub.spawner_class = "wrapspawner.ProfilesSpawner"

# Everything a lab job shares. The notebook and the engines run on the same allocation:
# one task with (engines + 1) cores, one core for the notebook itself.
_lab = {
    "req_partition": "",  # SITE: a partition with short queue times ("" = the cluster's default)
    "req_runtime": "03:00:00",  # one class, with margin (at most the partition's limit)
    "req_memory": "8G",  # the notebook and 4 engines (about 0.3 GB each with PyTorch loaded)
    # SITE: more sbatch options, e.g. "--nodes=1 --account=course --reservation=lab1".
    "req_options": "--nodes=1",
    # SITE: the shared course folder (after `make setup` there); the job runs this first.
    "req_prologue": "export PATH=/shared/ddlab/.venv/bin:$PATH",
    # The course kernel sets DDLAB_PROFILE=jupyterhub itself; this covers other kernels.
    "environment": {"DDLAB_PROFILE": "jupyterhub"},
    # The server is a step of the job. sbatch exports only the variables the hub passes
    # (--export=...), and srun inherits that list through SLURM_EXPORT_ENV: without
    # --export=ALL the step would lose the PATH the prologue set, and never start.
    "req_srun": "srun --export=ALL",
}
# How long the hub waits for a server; waiting in the queue counts against it. (On the
# wrapper, which is what the hub asks: a value in a profile's settings would not count.)
c.ProfilesSpawner.start_timeout = 300

c.ProfilesSpawner.profiles = [
    # (what students see, key, spawner, its settings)
    ("ddlab lab, 4 engines (5 cores)", "ddlab-4", "batchspawner.SlurmSpawner",
     {**_lab, "req_nprocs": "5"}),
    ("ddlab lab, 8 engines (9 cores)", "ddlab-8", "batchspawner.SlurmSpawner",
     {**_lab, "req_nprocs": "9", "req_memory": "14G"}),
    # A notebook on the hub's own machine whose engines go to the queue as a separate job
    # (profile slurm; clusters/slurm/settings.py says where).
    ("ddlab, engines as their own Slurm job", "ddlab-slurm", "jupyterhub.spawner.LocalProcessSpawner",
     {"environment": {"DDLAB_PROFILE": "slurm"}}),
]
