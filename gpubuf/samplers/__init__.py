"""Samplers: which items a sample reads."""

from gpubuf.samplers.base import Sampler
from gpubuf.samplers.consuming import ConsumingSampler
from gpubuf.samplers.ensemble import SamplerEnsemble
from gpubuf.samplers.prioritized import PrioritizedSampler
from gpubuf.samplers.shared import SharedPrioritizedSampler
from gpubuf.samplers.random import RandomSampler, SamplerWithoutReplacement

__all__ = ["Sampler", "ConsumingSampler", "RandomSampler", "SamplerWithoutReplacement", "PrioritizedSampler", "SharedPrioritizedSampler", "SamplerEnsemble"]
