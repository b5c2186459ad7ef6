# The default profile: MPI engines on this machine, started by the venv's mpiexec
# (ddlab.runtime.cluster fills in the mpiexec path and its flags).
c = get_config()  # noqa: F821 (provided by ipyparallel when it loads this file)

c.Cluster.engine_launcher_class = "mpi"
# Listen on loopback only: nobody else on the network can reach the engines.
c.Cluster.controller_ip = "127.0.0.1"
# Engines log warnings only, so a crash report shows MPI's own words, not start-up chatter.
c.EngineLauncher.engine_args = ["--log-level=WARN"]
# The controller pings engines every second, not every 3 (ipyparallel's default), and an engine
# counts as dead after 30 missed pings, 30 s as before: an engine registers only once its
# heart has answered, so 4 engines start in about 6 s instead of 9.
c.Cluster.controller_args = ["--HeartMonitor.period=1000", "--HeartMonitor.max_heartmonitor_misses=30"]
