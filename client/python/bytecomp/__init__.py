"""ByteComp's Python client.

  bytecomp.torch   PyTorch integration (init, DistributedOptimizer, broadcasts)
  bytecomp.run     the `bytecomp-run` local-cluster launcher
  bytecomp.env     the job's settings from the environment
  bytecomp._lib    ctypes binding over libbytecomp (the thin client's C ABI)

Importing this package loads nothing: libbytecomp is loaded on first use.
"""

from bytecomp._lib import (  # noqa: F401
    BytecompError,
    BytecompTimeout,
    DaemonUnavailableError,
    InvalidArgumentError,
    JobAbortedError,
    StateError,
    UnsupportedError,
    VersionMismatchError,
)
from bytecomp.env import EnvironmentConfigError  # noqa: F401

__all__ = [
    "BytecompError", "BytecompTimeout", "DaemonUnavailableError", "InvalidArgumentError",
    "JobAbortedError", "StateError", "UnsupportedError", "VersionMismatchError",
    "EnvironmentConfigError",
]
__version__ = "0.1.0"
