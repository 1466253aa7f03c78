"""Writers: where new items go."""

from gpubuf.writers.base import Writer
from gpubuf.writers.round_robin import RoundRobinWriter, TensorDictRoundRobinWriter

__all__ = ["Writer", "RoundRobinWriter", "TensorDictRoundRobinWriter"]
