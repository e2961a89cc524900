"""DeepSpeed plugin: a top-level ``"gradsync"`` section in the DeepSpeed config, read by
``gradsync.deepspeed.initialize``, a drop-in for ``deepspeed.initialize``.

Example section::

    "gradsync": {"scheduler": "us_byte", "compressor": {"type": "acp_sgd", "rank": 4}, "channels": 2}

Keys: scheduler, compressor, channels, profile, cost, trace, timeout, nonfinite, broadcast_buffers,
warmup_iterations, measure_iterations, plan_trials (as in ``gradsync.wrap``), options (planner
options), transport ("allreduce" or "forest") and topology (the forest's: a preset name or a
topology file).
"""
from .config import KEYS, SECTION
from .engine import GradSyncEngine, initialize

__all__ = ["GradSyncEngine", "KEYS", "SECTION", "initialize"]
