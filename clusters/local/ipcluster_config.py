# The default profile: MPI engines on this machine, started by the venv's mpiexec
# (ddlab.runtime.cluster fills in the mpiexec path and its flags).
c = get_config()  # noqa: F821 (provided by ipyparallel when it loads this file)

c.Cluster.engine_launcher_class = "mpi"
# Listen on loopback only: nobody else on the network can reach the engines.
c.Cluster.controller_ip = "127.0.0.1"
# Engines log warnings only, so a crash report shows MPI's own words, not start-up chatter.
c.EngineLauncher.engine_args = ["--log-level=WARN"]
