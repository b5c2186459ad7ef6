# Example JupyterHub configuration for teaching ddlab on a Slurm cluster: each student's
# notebook server runs as a Slurm job (batchspawner) sized for the lab's engines, and the
# course kernel (install_kernel.sh) starts the engines inside that job.
#
# Merge the parts you need into your hub's jupyterhub_config.py; it needs
# `pip install batchspawner wrapspawner` in the hub's environment. Adjust the partition,
# account and paths marked SITE.
c = get_config()  # noqa: F821 (provided by JupyterHub)

c.JupyterHub.spawner_class = "wrapspawner.ProfilesSpawner"

# Everything a lab job shares. The notebook and the engines run on the same allocation:
# one task with (engines + 1) cores, one core for the notebook itself.
_lab = {
    "req_partition": "teaching",  # SITE: a partition with short queue times
    "req_account": "",  # SITE: the course's account, if your site charges one
    "req_runtime": "03:00:00",  # one class, with margin
    "req_memory": "8G",  # the notebook and 4 engines (about 0.3 GB each with PyTorch loaded)
    "req_options": "--nodes=1",
    # SITE: the shared course folder (after `make setup` there); batchspawner runs this first.
    "req_prologue": "export PATH=/shared/ddlab/.venv/bin:$PATH",
    # The course kernel sets DDLAB_PROFILE=jupyterhub itself; this covers other kernels.
    "environment": {"DDLAB_PROFILE": "jupyterhub"},
    "start_timeout": 300,  # waiting in the queue counts against this
}

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
