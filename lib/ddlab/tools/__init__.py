"""The operator's tools: the `ddlab` command, the doctor, Slurm launchers, the lab generator, grading."""
