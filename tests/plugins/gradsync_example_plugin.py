"""A planner from a package outside gradsync, as a user would write one: layers grouped
`layers_per_op` at a time into one all-reduce each, output side first. Registered through the
entry point of its distribution (gradsync_example_plugin-0.1.dist-info) or `planners.register(SPEC)`."""
from gradsync.plan import Op, Plan, whole
from gradsync.planners import OVERLAP_FORWARD, PlannerSpec
from gradsync.registry import Option, positive_int


def plan(profile, cost, *, layers_per_op, overlap_forward):
    layers = [layer for layer in reversed(profile.layers) if layer.tensors]
    ops = tuple(Op(tuple(whole(tensor) for layer in layers[start:start + layers_per_op]
                         for tensor in reversed(layer.tensors)), priority=start // layers_per_op)
                for start in range(0, len(layers), layers_per_op))
    grouped = Plan(ops, options={"layers_per_op": layers_per_op})
    return grouped.with_deferred_waits() if overlap_forward else grouped


SPEC = PlannerSpec("layer_groups", plan, "a fixed number of layers per all-reduce, output side first",
                   options=(Option("layers_per_op", 2, positive_int, "layers per all-reduce"), OVERLAP_FORWARD))
