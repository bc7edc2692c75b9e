"""snapshotter: transparent freeze and thaw of running PyTorch jobs (see README.md).

Importing the package imports nothing else: the in-rank hook (snapshotter.hook) runs in the
job's interpreter, which has only the standard library and the job's own packages.
"""

__version__ = "0.2.0"
