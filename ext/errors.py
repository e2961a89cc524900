"""The errors gradsync raises for bad input, so front-ends can report them without a traceback."""


class ConfigError(ValueError):
    """A configuration value, file or argument is invalid; the message names the field."""


class PeersTimedOut(RuntimeError):
    """The other ranks did not all reach one of gradsync's collectives within `timeout` (one
    stalled, failed or exited); the message names the collective."""


class GradientsChangedInFlight(RuntimeError):
    """Gradients changed while their ops were averaging them, before ``optimizer.step()``: changed in
    place (clipped) or replaced before ``optimizer.synchronize()``, or accumulated into by a backward
    pass that bypassed the model's outputs (``runtime.output_start``). Raised before any update."""


class ParametersChangedBeforeUpdate(RuntimeError):
    """Parameters written in place after ``optimizer.step()`` while their update waited for their
    next forward (updates deferred under ``overlap_forward`` or US-Byte's forward-phase ops): the
    update would land on what was written (a clamp, an assignment), which it precedes in the code.
    Raised before that update; ``optimizer.synchronize()`` after the step applies it first."""


def unknown_name(kind: str, name: object, valid) -> ConfigError:
    """The error for a name that is not among the valid ones, listing them.

    Returned, not raised: the caller raises it (or puts its message into its own).

    Args:
        kind: what the name names, for the message (e.g. ``"model"``, ``"data set"``).
        name: the name given (any object; shown with ``repr``).
        valid: the valid names (any iterable of strings, e.g. a dict's keys); listed sorted.
    """
    return ConfigError(f"unknown {kind} {name!r}; valid: {', '.join(sorted(valid))}")
