"""dpr-gc: dense passage retrieval with Gradient Cache."""

from .grad_cache import GradCache
from .loss import DistributedContrastiveLoss, SimpleContrastiveLoss

__version__ = "0.1.0"
__all__ = ["GradCache", "SimpleContrastiveLoss", "DistributedContrastiveLoss"]
