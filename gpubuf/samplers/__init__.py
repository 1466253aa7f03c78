"""Samplers: which items a sample reads."""

from gpubuf.samplers.base import Sampler
from gpubuf.samplers.consuming import ConsumingSampler
from gpubuf.samplers.prompt_group import PromptGroupSampler
from gpubuf.samplers.staleness import StalenessAwareSampler
from gpubuf.samplers.ensemble import SamplerEnsemble
from gpubuf.samplers.prioritized import PrioritizedSampler
from gpubuf.samplers.prioritized_slice import PrioritizedSliceSampler
from gpubuf.samplers.shared import SharedPrioritizedSampler
from gpubuf.samplers.random import RandomSampler, SamplerWithoutReplacement
from gpubuf.samplers.slice import SliceSampler, SliceSamplerWithoutReplacement
from gpubuf.samplers.streaming_slice import StreamingSliceSampler

__all__ = ["Sampler", "ConsumingSampler", "PromptGroupSampler", "StalenessAwareSampler", "RandomSampler", "SamplerWithoutReplacement", "PrioritizedSampler", "SharedPrioritizedSampler", "SamplerEnsemble", "SliceSampler", "SliceSamplerWithoutReplacement", "PrioritizedSliceSampler", "StreamingSliceSampler"]
