"""The data set as files: one copy on the "shared file system", one partition per rank on "node-local storage".

At scale the training set lives on a parallel file system that every node reads,
and each node has a local disk (an SSD, or memory) that holds a part of it. Here both
are folders of NumPy files (`x.npy`, `y.npy`, `ids.npy`), memory-mapped when read, in a
temporary directory made for the run (never inside the repository):

    <root>/shared/        all n samples, written once by rank 0
    <root>/local/rank<r>/ rank r's partition, copied from the shared copy by `stage`

The shared copy is stored **sorted by a target** (the yield strength by default), as
data sets often are (simulations written in the order of a parameter sweep,
experiments by date). Rank r's partition is block r of that file, so local storage
holds a biased slice of the data: non-IID across ranks.

`SampleFiles.read` counts the bytes it reads, so that each shuffling strategy can
say how much it took from shared storage, from local storage, and over the network.
"""

from __future__ import annotations

import shutil
import tempfile
from pathlib import Path

import numpy as np
from mpi4py import MPI

from ..data.curves import StressStrainCurves
from ..runtime.blocks import block_range

FILES = ("x", "y", "ids")


class SampleFiles:
    """x, y and ids of a folder, memory-mapped; `read(positions)` returns rows and counts their bytes."""

    def __init__(self, folder: Path | str):
        self.folder = Path(folder)
        self.x, self.y, self.ids = (np.load(self.folder / f"{name}.npy", mmap_mode="r") for name in FILES)
        self.bytes_read = 0

    def __len__(self) -> int:
        return len(self.ids)

    @property
    def row_bytes(self) -> int:
        """Bytes of one sample: its features and its targets."""
        return self.x[0].nbytes + self.y[0].nbytes

    def read(self, positions: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(x, y) of the samples at these positions of the files, in this order, as arrays in memory."""
        positions = np.asarray(positions, dtype=np.int64)
        self.bytes_read += len(positions) * self.row_bytes
        return np.asarray(self.x[positions]), np.asarray(self.y[positions])


def write_files(folder: Path, x: np.ndarray, y: np.ndarray, ids: np.ndarray) -> None:
    """Write (or replace) the three files of a folder; each appears whole (write, then rename)."""
    folder.mkdir(parents=True, exist_ok=True)
    for name, values in zip(FILES, (x, y, ids)):
        partial = folder / f".{name}.npy"
        np.save(partial, np.ascontiguousarray(values))
        partial.replace(folder / f"{name}.npy")


def write_shared(comm: MPI.Comm, data: StressStrainCurves, sort_by: int = 0, root: Path | None = None) -> Path:
    """Rank 0 writes all samples of `data`, sorted by target `sort_by`, to <root>/shared; all get <root>.

    root defaults to a new temporary directory (remove it with `remove_store`). Sample
    id i is row i of the sorted file; ids.npy records that (and travels with the rows).
    """
    if not 0 <= sort_by < 2:
        raise ValueError(f"sort_by picks one of the 2 targets (0 or 1), got {sort_by}")
    if comm.Get_rank() == 0:
        root = Path(root) if root is not None else Path(tempfile.mkdtemp(prefix="ddlab-shuffling-"))
        order = np.argsort(data.targets(np.arange(len(data)))[:, sort_by], kind="stable")
        x, y = data[order]
        write_files(root / "shared", x.numpy(), y.numpy(), np.arange(len(data), dtype=np.int64))
    root = comm.bcast(root, root=0)
    comm.Barrier()
    return root


def stage(comm: MPI.Comm, root: Path) -> tuple[SampleFiles, SampleFiles]:
    """Copy block `rank` of the shared copy to <root>/local/rank<r>; return (shared, local) readers.

    The copy counts as bytes read from shared storage (`shared.bytes_read`).
    """
    shared = SampleFiles(root / "shared")
    block = block_range(len(shared), comm.Get_rank(), comm.Get_size())
    positions = np.arange(block.start, block.stop)
    x, y = shared.read(positions)
    folder = root / "local" / f"rank{comm.Get_rank()}"
    write_files(folder, x, y, np.asarray(shared.ids[positions]))
    comm.Barrier()
    return shared, SampleFiles(folder)


def remove_store(comm: MPI.Comm, root: Path) -> None:
    """Delete the folder tree made by `write_shared` (rank 0, after every rank is done with it)."""
    comm.Barrier()
    if comm.Get_rank() == 0:
        shutil.rmtree(root, ignore_errors=True)
