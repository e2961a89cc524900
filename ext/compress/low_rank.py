"""What the low-rank codecs (ACP-SGD, Power-SGD) share: their options, which tensors they
compress, and the error-feedback update."""
from __future__ import annotations

import math
import warnings
from dataclasses import replace
from typing import Mapping

import torch

from ..errors import ConfigError
from ..profile import TensorSpec
from ..triton_kernels import error_feedback_update
from ..triton_kernels.common import FLOAT_DTYPES, MAX_RANK

BLOCK_BYTES = 1 << 20  # about one core's L2 cache
# the `wire_dtype` option: the factors (and the tensors sent whole beside them) travel in this type,
# as under torch's fp16_compress_wrapper; None keeps the gradients' type
WIRE_DTYPES = {"float16": torch.float16, "bfloat16": torch.bfloat16}


def check_options(codec: str, rank, min_compression_rate, start_iter, **switches) -> None:
    """The options both take: rank >= 1, min_compression_rate >= 0, start_iter >= 0, and boolean
    switches (error_feedback, reuse / warm_start).

    Args:
        codec: the compressor's name, quoted in the error message.
        rank: the requested rank r, an integer >= 1.
        min_compression_rate: a finite number >= 0: a matrix is compressed only when it shrinks by
            more than this factor (see select_matrices).
        start_iter: the number of uncompressed warm-up steps, an integer >= 0.
        switches: the boolean options, by name.
    """
    if isinstance(rank, bool) or not isinstance(rank, int) or rank <= 0:
        raise ConfigError(f"compressor {codec!r}: 'rank' must be an integer >= 1, got {rank!r}")
    if isinstance(min_compression_rate, bool) or not isinstance(min_compression_rate, (int, float)) \
            or not math.isfinite(min_compression_rate) or min_compression_rate < 0:
        raise ConfigError(f"compressor {codec!r}: 'min_compression_rate' must be a number >= 0, "
                          f"got {min_compression_rate!r}")
    if isinstance(start_iter, bool) or not isinstance(start_iter, int) or start_iter < 0:
        raise ConfigError(f"compressor {codec!r}: 'start_iter' must be an integer >= 0, got {start_iter!r}")
    for field, value in switches.items():
        if not isinstance(value, bool):
            raise ConfigError(f"compressor {codec!r}: {field!r} must be true or false, got {value!r}")


def check_wire_dtype(codec: str, wire_dtype) -> None:
    """The `wire_dtype` option: None or a name of WIRE_DTYPES."""
    if wire_dtype is not None and wire_dtype not in WIRE_DTYPES:
        raise ConfigError(f"compressor {codec!r}: 'wire_dtype' must be null or one of {sorted(WIRE_DTYPES)}, "
                          f"got {wire_dtype!r}")


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype a low-rank codec forms a gradient's factors and keeps its error feedback in:
    fp32 for 16-bit gradients, the gradient's own otherwise. A factor entry sums a row (or column)
    of M + E against an orthonormal query, up to √m·max|M + E|: past fp16's 65504 at loss scales
    the gradients themselves survive. And bf16's 8-bit mantissa drops the small residuals that
    error feedback accumulates."""
    return torch.float32 if dtype in (torch.float16, torch.bfloat16) else dtype


def layout_wire_dtype(wire_dtype: str | None, compressed: bool, gradient_dtype: torch.dtype) -> torch.dtype:
    """What travels in a layout: `wire_dtype` if set; else in a compressed layout (factors and the
    tensors sent whole beside them) the compute dtype, in the uncompressed warm-up the gradients'.

    Args:
        wire_dtype: the codec's `wire_dtype` option, a name of WIRE_DTYPES or None.
        compressed: whether the layout carries factors (not the uncompressed warm-up).
        gradient_dtype: the dtype of the gradients the layout's op carries.
    """
    if wire_dtype is not None:
        return WIRE_DTYPES[wire_dtype]
    return compute_dtype(gradient_dtype) if compressed else gradient_dtype


def on_the_wire(spec: TensorSpec, wire_dtype: str | None, compressed: bool) -> TensorSpec:
    """`spec` with the element size that travels (layout_wire_dtype's, from the element size alone:
    2-byte gradients are fp16 or bf16).

    Args:
        spec: the tensor as it travels in the layout, at the gradient's element size.
        wire_dtype, compressed: as in layout_wire_dtype.
    """
    if wire_dtype is not None:
        return replace(spec, bytes_per_element=WIRE_DTYPES[wire_dtype].itemsize)
    if compressed and spec.bytes_per_element == 2:
        return replace(spec, bytes_per_element=torch.float32.itemsize)
    return spec


def select_matrices(codec: str, specs: Mapping[str, TensorSpec], rank: int,
                    min_compression_rate: float) -> dict[str, tuple[int, int, int]]:
    """(n, m, r) of every tensor worth compressing: viewed as (shape[0], −1), compressed iff
    (n + m)·r·min_compression_rate < n·m (the torch PowerSGD hook's rule), r = min(rank, n, m)
    with one warning for all the compressed tensors clipped.

    Args:
        codec: the compressor's name, quoted in the warning.
        specs: the tensors by name, as given to ``Codec.setup``; those without a matrix shape
            (vectors, or no shape known) are never compressed.
        rank: the requested rank, an integer >= 1.
        min_compression_rate: as in check_options.
    """
    shapes, clipped = {}, []
    for name in sorted(specs):
        matrix = specs[name].matrix_shape()
        if matrix is None:
            continue
        n, m = matrix
        r = min(rank, n, m)
        if (n + m) * r * min_compression_rate < n * m:
            shapes[name] = (n, m, r)
            if r < rank:
                clipped.append(name)
    if clipped:
        warnings.warn(f"{codec}: rank {rank} exceeds min(n, m) of {len(clipped)} tensor(s) "
                      f"(e.g. {clipped[0]!r}); clipped to min(n, m) for those", stacklevel=3)
    return shapes


def error_buffer(errors: dict[str, torch.Tensor], name: str, like: torch.Tensor) -> torch.Tensor:
    """The error-feedback matrix of `name`: zeros at first, moved to `like`'s device and dtype once
    after a checkpoint load.

    Args:
        errors: the codec's error matrices by tensor name; the buffer returned is stored there.
        name: the tensor's name.
        like: the gradient matrix (n, m) whose shape, dtype and device a new error takes.
    """
    error = errors.get(name)
    if error is None:
        error = torch.zeros_like(like)
    elif error.device != like.device or error.dtype != like.dtype:
        error = error.to(device=like.device, dtype=like.dtype)
    errors[name] = error
    return error


def cpu_copies(tensors: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Detached CPU copies, for checkpoints."""
    return {name: tensor.detach().cpu().clone() for name, tensor in tensors.items()}


def check_saved_state(codec: str, saved_options: dict, options: dict, saved_names, compressed) -> None:
    """A checkpoint's state fits this codec: same options, factors only of compressed tensors.

    Args:
        codec: the compressor's name, quoted in the error message.
        saved_options, options: the checkpoint's options and this codec's own; they must be equal.
        saved_names: the names of the tensors whose factors were saved.
        compressed: the names of the tensors this codec compresses.
    """
    if saved_options != options:
        raise ConfigError(f"{codec} state was saved with options {saved_options}, this run uses {options}")
    unknown = sorted(set(saved_names) - set(compressed))
    if unknown:
        raise ConfigError(f"{codec} state holds factors of tensors this model does not compress: {unknown[:5]}")


def row_blocks(matrix: torch.Tensor) -> list[slice]:
    """Row ranges of about BLOCK_BYTES of a CPU matrix (one range elsewhere): operations fused per
    range read the matrix from main memory once and find the range in cache for the next one, and
    MKL's products with r ≪ m columns run about 2× faster on such blocks than on a whole large
    matrix."""
    if matrix.device.type != "cpu":
        return [slice(None)]
    rows = max(1, BLOCK_BYTES // (matrix.shape[1] * matrix.element_size()))
    return [slice(start, start + rows) for start in range(0, matrix.shape[0], rows)]


def fused_update_available(error: torch.Tensor, rank: int) -> bool:
    """Whether the fused Triton error-feedback kernel serves `error` (CUDA, fp16/fp32, r ≤ 32)."""
    return error.is_cuda and error.dtype in FLOAT_DTYPES and rank <= MAX_RANK


def subtract_low_rank(matrix: torch.Tensor, error: torch.Tensor, p: torch.Tensor, q: torch.Tensor,
                      out: torch.Tensor | None = None) -> None:
    """out ← M + E − P·Qᵀ (E itself by default): the fused Triton kernel where available, which
    never materialises P·Qᵀ; elsewhere two torch operations per row block (BLAS accumulates P·Qᵀ
    into the block while it is in cache).

    Args:
        matrix: the gradient M (n, m), floating.
        error: the error-feedback matrix E (n, m), M's dtype and device.
        p, q: the factors P (n, r) and Q (m, r), M's dtype and device.
        out: the (n, m) matrix written, M's dtype and device; None writes into E.
    """
    out = error if out is None else out
    if fused_update_available(error, p.shape[1]):
        error_feedback_update(matrix, error, p.contiguous(), q.contiguous(), out=out)
        return
    for rows in row_blocks(error):
        torch.add(error[rows], matrix[rows], out=out[rows]).addmm_(p[rows], q.T, alpha=-1)


def write_low_rank(out: torch.Tensor, p: torch.Tensor, q: torch.Tensor) -> None:
    """out ← P·Qᵀ (the decompressed gradient), written per row block; formed in the factors' dtype
    and rounded once into a 16-bit `out`.

    Args:
        out: the contiguous (n, m) matrix written, e.g. the flat gradient viewed as (n, m).
        p, q: the factors P (n, r) and Q (m, r), on out's device, of out's dtype or compute_dtype's.
    """
    for rows in row_blocks(out):
        if out.dtype == p.dtype:
            torch.mm(p[rows], q.T, out=out[rows])
        else:
            out[rows].copy_(p[rows] @ q.T)


def spare_buffer(spares: dict[tuple, list[torch.Tensor]], like: torch.Tensor) -> torch.Tensor:
    """A free buffer of `like`'s shape, dtype and device (a new one when none is free): the new
    error is written there while the old one stays intact until the step is known to be applied."""
    free = spares.get(_buffer_key(like))
    return free.pop() if free else torch.empty_like(like)


def keep_error(errors: dict[str, torch.Tensor], spares: dict[tuple, list[torch.Tensor]], name: str,
               new_error: torch.Tensor, accepted: bool) -> None:
    """Make `new_error` (a spare_buffer) the error of `name` and spare the old one; or, when the
    step was not `accepted`, keep the old error and spare `new_error`. An error formed in place
    (`new_error` is the current one) stays.

    Args:
        errors: the codec's current error matrices by tensor name (holding `name` when `accepted`).
        spares: the free buffers by (shape, dtype, device), as spare_buffer takes them.
        name: the tensor's name.
        new_error: the error this step computed.
        accepted: whether the step's gradient was applied.
    """
    if new_error is errors.get(name):
        return
    if accepted:
        new_error, errors[name] = errors[name], new_error
    spares.setdefault(_buffer_key(new_error), []).append(new_error)


def _buffer_key(tensor: torch.Tensor) -> tuple:
    return tuple(tensor.shape), tensor.dtype, tensor.device
