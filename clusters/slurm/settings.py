# Where and how the engines run on your Slurm cluster: the one file to edit for your site.
# Any setting can be overridden per user or per shell with an environment variable
# DDLAB_SLURM_<NAME>, e.g. `export DDLAB_SLURM_PARTITION=teaching`.
# `ddlab doctor --profile slurm` checks the result end to end.

# Partition (queue) for the engines' job; "" = the cluster's default partition.
partition = ""

# Account charged for the job; "" = your default account.
account = ""

# Wall-clock limit of the engines' job (sbatch --time), a bit longer than a class.
# It must not exceed the partition's limit (`sinfo -o "%P %l"`), or the job never starts.
time = "02:00:00"

# Engines (MPI ranks) per node: start(n=8) with 4 per node asks for 2 nodes.
engines_per_node = 4

# CPU cores per engine (sbatch --cpus-per-task); also each engine's number of math threads.
cpus_per_engine = 1

# How the job turns the engines into MPI ranks:
#   "auto"    -> "mpiexec" for Open MPI, "srun" for MPICH (what works with the PyPI wheels)
#   "mpiexec" -> the course environment's own mpiexec, inside the job's allocation
#   "srun"    -> Slurm starts every rank itself, speaking the PMI named by `mpi` below
launcher = "auto"

# With launcher "srun": srun --mpi=<this>. "auto" = pmi2 for MPICH, pmix for Open MPI
# (Open MPI 5 speaks only PMIx, and needs a Slurm built with a PMIx as new as its own).
# `srun --mpi=list` shows what your Slurm offers.
mpi = "auto"

# The address of the machine running the notebook (login node, JupyterHub node) that
# compute nodes can reach; the controller listens on it alone. "" = the address this
# host's name resolves to (or its first non-loopback interface). On hosts with several
# networks, put the cluster-internal one here (`hostname -I` lists them).
controller_address = ""

# The network interface the ranks' MPI traffic may use between nodes, e.g. "ib0" or "eth1" (Open MPI
# also takes a subnet, "10.1.0.0/16"): the ranks' TCP transport listens there alone, and the launcher
# sends there (Open MPI: btl_tcp_if_include and prte_if_include, though PRRTE's daemons still listen
# on every interface; MPICH: UCX_NET_DEVICES, FI_TCP_IFACE, HYDRA_IFACE). "" = every interface,
# reachable from every network the nodes are on (`ddlab doctor` warns). Variables you export
# yourself (e.g. OMPI_MCA_btl_tcp_if_include) win over this. docs/hpc.md, "Where MPI listens".
network_interface = ""

# Python that runs the engines on compute nodes; "" = the notebook's own (so the course
# environment must live on a file system the compute nodes see, e.g. your home).
python = ""

# More sbatch options, e.g. ["--qos=course", "--reservation=lab1", "--mem-per-cpu=2G"].
sbatch_options = []
