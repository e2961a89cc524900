"""DeepSpeed plugin: a top-level ``"gradsync"`` section in the DeepSpeed config, honoured by
``deepspeed.initialize`` itself once ``gradsync`` is imported (``gradsync.deepspeed_entry``), and
so by every route that builds DeepSpeed's engine. ``gradsync.deepspeed.initialize`` is
``deepspeed.initialize``.

Example section::

    "gradsync": {"scheduler": "us_byte", "compressor": {"type": "acp_sgd", "rank": 4}, "channels": 2}

Keys: scheduler, compressor, channels, profile, cost, trace, timeout, nonfinite, broadcast_buffers,
warmup_iterations, measure_iterations, plan_trials, replan (as in ``gradsync.wrap``), options (planner
options), transport ("allreduce" or "forest") and topology (the forest's: a preset name or a
topology file).
"""
from deepspeed import initialize

from .config import KEYS, SECTION
from .engine import GradSyncEngine

__all__ = ["GradSyncEngine", "KEYS", "SECTION", "initialize"]
