"""dpr-gc: dense passage retrieval with Gradient Cache."""

from .engine.grad_cache import GradCache
from .engine.loss import DistributedContrastiveLoss, SimpleContrastiveLoss

__version__ = "0.1.0"
__all__ = ["GradCache", "SimpleContrastiveLoss", "DistributedContrastiveLoss"]
