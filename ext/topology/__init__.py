"""Topology-adaptive forest packing (forest-packing in gradsync.bibliography, "the paper" in this
package): plan reduce/broadcast trees on a network.

`Topology` (model.py, presets.py) describes the network; `plan_forest` (packing.py) solves
problem (4) or (8) and returns a `ForestPacking` (forest.py); `ForestAllReduce` (allreduce.py)
executes it on torch.distributed; baselines.py gives the paper's baselines' times on the same topology.
"""
from .allreduce import ForestAllReduce
from .baselines import BASELINES, baseline_time, nccl_double_tree
from .forest import BROADCAST, OVERLAP, REDUCE, ForestPacking, Tree, largest_remainder
from .model import Link, Topology, load
from .packing import max_packing, plan_forest
from .presets import active_from_spec, cluster, complete, dgx1, preset, ring

__all__ = ["BASELINES", "BROADCAST", "OVERLAP", "REDUCE", "ForestAllReduce", "ForestPacking", "Link", "Topology", "Tree",
           "active_from_spec", "baseline_time", "cluster", "complete", "dgx1", "largest_remainder", "load",
           "max_packing", "nccl_double_tree", "plan_forest", "preset", "ring"]
