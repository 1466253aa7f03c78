"""Writers: where new items go."""

from gpubuf.writers.base import Writer
from gpubuf.writers.ensemble import WriterEnsemble
from gpubuf.writers.immutable import ImmutableDatasetWriter
from gpubuf.writers.max_value import TensorDictMaxValueWriter
from gpubuf.writers.round_robin import RoundRobinWriter, TensorDictRoundRobinWriter

__all__ = [
    "Writer",
    "RoundRobinWriter",
    "TensorDictRoundRobinWriter",
    "TensorDictMaxValueWriter",
    "ImmutableDatasetWriter",
    "WriterEnsemble",
]
