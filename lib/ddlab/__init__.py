"""ddlab: the library behind the labs on scaling deep-learning training with MPI.

Each lab adds one module holding the reference version of what it teaches, so later
labs can build on it even when a student's own version is unfinished.
"""

__version__ = "0.1.0"
