"""ModelProfile: a model's gradient tensors in layer order with per-layer compute times."""
from __future__ import annotations

import json
import math
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Iterator

from ..errors import ConfigError

_DTYPE_BYTES = {1, 2, 4, 8}


@dataclass(frozen=True)
class TensorSpec:
    """One gradient tensor: a unique name, its element count, bytes per element and, when known,
    its shape (compressors view a tensor as a matrix (shape[0], numel / shape[0]))."""

    name: str
    numel: int
    bytes_per_element: int = 4
    shape: tuple[int, ...] | None = None

    @property
    def nbytes(self) -> int:
        return self.numel * self.bytes_per_element

    def matrix_shape(self) -> tuple[int, int] | None:
        """(n, m) for a tensor of two or more dimensions, else None (vectors are never compressed)."""
        if self.shape is None or len(self.shape) < 2:
            return None
        return self.shape[0], self.numel // self.shape[0]


@dataclass(frozen=True)
class LayerProfile:
    """One layer (a module that owns parameters) with its forward and backward times in seconds, and
    its update time: the serial work of applying its gradients (optimizer step, a codec's decoding)."""

    name: str
    tensors: tuple[TensorSpec, ...]
    forward_time: float
    backward_time: float
    update_time: float = 0.0

    @property
    def numel(self) -> int:
        return sum(t.numel for t in self.tensors)

    @property
    def nbytes(self) -> int:
        return sum(t.nbytes for t in self.tensors)


@dataclass(frozen=True)
class ModelProfile:
    """Layers in input → output order; backward runs them in reverse.

    Layer l's gradients are ready when its backward ends, at ``backward_ready_times()[l]``
    measured from the start of the backward pass (us-byte eq. 2).
    """

    name: str
    layers: tuple[LayerProfile, ...]
    metadata: dict[str, Any] = field(default_factory=dict, compare=False)

    def __post_init__(self) -> None:
        self.validate()

    # -- derived quantities -------------------------------------------------------------
    def tensors(self) -> Iterator[TensorSpec]:
        for layer in self.layers:
            yield from layer.tensors

    def tensor_map(self) -> dict[str, TensorSpec]:
        return {t.name: t for t in self.tensors()}

    def layer_of_tensor(self) -> dict[str, int]:
        return {t.name: i for i, layer in enumerate(self.layers) for t in layer.tensors}

    @property
    def num_tensors(self) -> int:
        return sum(len(layer.tensors) for layer in self.layers)

    @property
    def num_parameters(self) -> int:
        return sum(layer.numel for layer in self.layers)

    @property
    def total_bytes(self) -> int:
        return sum(layer.nbytes for layer in self.layers)

    @property
    def forward_time(self) -> float:
        return sum(layer.forward_time for layer in self.layers)

    @property
    def backward_time(self) -> float:
        return sum(layer.backward_time for layer in self.layers)

    @property
    def update_time(self) -> float:
        return sum(layer.update_time for layer in self.layers)

    def with_update_time(self, seconds: float) -> "ModelProfile":
        """This profile with `seconds` of update time shared by the layers in proportion to their
        gradient bytes (the optimizer step and decoding scale with the parameters)."""
        total = self.total_bytes
        layers = tuple(replace(layer, update_time=seconds * layer.nbytes / total) for layer in self.layers)
        return ModelProfile(self.name, layers, dict(self.metadata))

    def backward_start_times(self) -> list[float]:
        """τ_b(l) for every layer, with τ_b(L) = 0 (us-byte eq. 2, asc-wfbp Alg. 1 lines 2–5)."""
        starts = [0.0] * len(self.layers)
        clock = 0.0
        for index in range(len(self.layers) - 1, -1, -1):
            starts[index] = clock
            clock += self.layers[index].backward_time
        return starts

    def backward_ready_times(self) -> list[float]:
        """τ_b(l) + t_b(l): when layer l's gradients are computed."""
        return [s + layer.backward_time for s, layer in zip(self.backward_start_times(), self.layers)]

    def scaled(self, compute_factor: float) -> "ModelProfile":
        """The same model on a device `compute_factor` times slower (times multiplied)."""
        if not compute_factor > 0:
            raise ConfigError(f"compute_factor must be > 0, got {compute_factor!r}")
        layers = tuple(
            LayerProfile(l.name, l.tensors, l.forward_time * compute_factor, l.backward_time * compute_factor,
                         l.update_time * compute_factor)
            for l in self.layers
        )
        return ModelProfile(self.name, layers, dict(self.metadata))

    # -- validation and JSON --------------------------------------------------------------
    def validate(self) -> None:
        if not self.layers:
            raise ConfigError(f"profile {self.name!r}: 'layers' is empty")
        seen: set[str] = set()
        for index, layer in enumerate(self.layers):
            where = f"profile {self.name!r}: layers[{index}] ({layer.name!r})"
            for attr in ("forward_time", "backward_time", "update_time"):
                value = getattr(layer, attr)
                if not isinstance(value, (int, float)) or not math.isfinite(value) or value < 0:
                    raise ConfigError(f"{where}: '{attr}' must be a finite number >= 0, got {value!r}")
            for tensor in layer.tensors:
                if not tensor.name:
                    raise ConfigError(f"{where}: a tensor has an empty 'name'")
                if tensor.name in seen:
                    raise ConfigError(f"{where}: tensor name {tensor.name!r} appears twice")
                seen.add(tensor.name)
                if isinstance(tensor.numel, bool) or not isinstance(tensor.numel, int) or tensor.numel <= 0:
                    raise ConfigError(f"{where}: tensor {tensor.name!r} 'numel' must be a positive integer")
                if tensor.shape is not None and math.prod(tensor.shape) != tensor.numel:
                    raise ConfigError(f"{where}: tensor {tensor.name!r} 'shape' {list(tensor.shape)} "
                                      f"does not hold 'numel' {tensor.numel} elements")
                if tensor.bytes_per_element not in _DTYPE_BYTES:
                    raise ConfigError(
                        f"{where}: tensor {tensor.name!r} 'bytes_per_element' must be one of "
                        f"{sorted(_DTYPE_BYTES)}, got {tensor.bytes_per_element!r}"
                    )
        if not seen:
            raise ConfigError(f"profile {self.name!r}: no layer has a gradient tensor")

    def to_dict(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "metadata": self.metadata,
            "layers": [
                {
                    "name": l.name,
                    "forward_time": l.forward_time,
                    "backward_time": l.backward_time,
                    "update_time": l.update_time,
                    "tensors": [_tensor_dict(t) for t in l.tensors],
                }
                for l in self.layers
            ],
        }

    @classmethod
    def from_dict(cls, data: Any) -> "ModelProfile":
        if not isinstance(data, dict):
            raise ConfigError("profile JSON must be an object with 'name' and 'layers'")
        layers_data = data.get("layers")
        if not isinstance(layers_data, list) or not layers_data:
            raise ConfigError("profile JSON: 'layers' must be a non-empty list")
        layers = []
        for index, entry in enumerate(layers_data):
            where = f"profile JSON: layers[{index}]"
            if not isinstance(entry, dict):
                raise ConfigError(f"{where} must be an object")
            missing = {"name", "forward_time", "backward_time", "tensors"} - entry.keys()
            if missing:
                raise ConfigError(f"{where}: missing field(s) {sorted(missing)}")
            if not isinstance(entry["tensors"], list):
                raise ConfigError(f"{where}: 'tensors' must be a list")
            tensors = []
            for t_index, t in enumerate(entry["tensors"]):
                if not isinstance(t, dict) or "name" not in t or "numel" not in t:
                    raise ConfigError(f"{where}.tensors[{t_index}]: needs 'name' and 'numel'")
                shape = t.get("shape")
                if shape is not None and (not isinstance(shape, list) or not all(isinstance(d, int) for d in shape)):
                    raise ConfigError(f"{where}.tensors[{t_index}]: 'shape' must be a list of integers")
                tensors.append(TensorSpec(str(t["name"]), t["numel"], t.get("bytes_per_element", 4),
                                          None if shape is None else tuple(shape)))
            layers.append(
                LayerProfile(str(entry["name"]), tuple(tensors), entry["forward_time"], entry["backward_time"],
                             entry.get("update_time", 0.0))
            )
        metadata = data.get("metadata") or {}
        if not isinstance(metadata, dict):
            raise ConfigError(f"profile JSON: 'metadata' must be an object, got {type(metadata).__name__}")
        return cls(str(data.get("name", "profile")), tuple(layers), dict(metadata))

    def save(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps(self.to_dict(), indent=1))

    @classmethod
    def load(cls, path: str | Path) -> "ModelProfile":
        try:
            data = json.loads(Path(path).read_text())
        except json.JSONDecodeError as exc:
            raise ConfigError(f"profile JSON {str(path)!r} is malformed: {exc}") from exc
        return cls.from_dict(data)


def _tensor_dict(tensor: TensorSpec) -> dict[str, Any]:
    data: dict[str, Any] = {"name": tensor.name, "numel": tensor.numel, "bytes_per_element": tensor.bytes_per_element}
    if tensor.shape is not None:
        data["shape"] = list(tensor.shape)
    return data
