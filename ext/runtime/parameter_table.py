"""The live model's parameter table: trainable parameters grouped by the module that owns them."""
from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import Iterable

import torch
from torch import nn

from ..errors import ConfigError
from ..profile import LayerProfile, ModelProfile, TensorSpec


@dataclass(frozen=True)
class ParameterTable:
    """Trainable parameters by qualified name (a shared parameter once, under its first name) and
    the modules that own them, in `module_order` (input → output once measured, else registration).
    A shared parameter's first module owns it; the others holding it are its `borrowers`. Trainable
    parameters without elements have nothing to average: they are `empty`, left out of the plans (a
    torch DDP bucket holds no element of theirs either). The `frozen` ones (by name) are watched:
    should one train later (``unfrozen``), its gradients are averaged only once the runtime has made
    a table and plans that hold it (``GradSync``)."""

    parameters: dict[str, nn.Parameter]
    owners: dict[str, list[str]]  # module name -> names of the parameters it owns directly
    modules: dict[str, nn.Module]
    # module name -> (module, owner modules of the shared parameters it holds directly but does not own)
    borrowers: dict[str, tuple[nn.Module, list[str]]] = field(default_factory=dict)
    empty: tuple[nn.Parameter, ...] = ()
    frozen: dict[str, nn.Parameter] = field(default_factory=dict)

    @classmethod
    def of(cls, model: nn.Module, kept: Iterable[nn.Parameter] = ()) -> "ParameterTable":
        """The table of `model`'s parameters that train now, and of those in `kept` (an earlier
        table's, frozen for now: a GAN's discriminator during the generator's step)."""
        kept_ids = {id(parameter) for parameter in kept}
        parameters: dict[str, nn.Parameter] = {}
        owners: dict[str, list[str]] = {}
        modules: dict[str, nn.Module] = {}
        borrowers: dict[str, tuple[nn.Module, list[str]]] = {}
        owner_of: dict[int, str] = {}  # parameter id -> its owner module
        empty: dict[int, nn.Parameter] = {}
        frozen: dict[str, nn.Parameter] = {}
        frozen_ids: set[int] = set()
        for module_name, module in model.named_modules():
            for local_name, parameter in module.named_parameters(recurse=False):
                name = f"{module_name}.{local_name}" if module_name else local_name
                if not parameter.requires_grad and id(parameter) not in kept_ids:
                    if id(parameter) not in frozen_ids:
                        frozen_ids.add(id(parameter))
                        frozen[name] = parameter
                    continue
                if parameter.numel() == 0:
                    empty[id(parameter)] = parameter
                    continue
                if id(parameter) in owner_of:
                    _borrow(borrowers, module_name, module, owner_of[id(parameter)])
                    continue
                owner_of[id(parameter)] = module_name
                parameters[name] = parameter
                owners.setdefault(module_name, []).append(name)
                modules[module_name] = module
        if not parameters:
            raise ConfigError("model has no trainable parameters with elements: nothing to synchronise")
        sparse = [name for name, module in modules.items()
                  if isinstance(module, (nn.Embedding, nn.EmbeddingBag)) and module.sparse]
        if sparse:
            raise ConfigError(f"modules {sparse} make sparse gradients (sparse=True), which gradsync cannot "
                              "all-reduce: construct them with sparse=False")
        _check_dtypes(parameters)
        return cls(parameters, owners, modules, borrowers, tuple(empty.values()), frozen)

    @property
    def device(self):
        """The device of the (first) parameter: where the runtime's own tensors go."""
        return next(iter(self.parameters.values())).device

    def profile(
        self,
        name: str,
        module_order: list[str] | None = None,
        forward_times: dict[str, float] | None = None,
        backward_times: dict[str, float] | None = None,
    ) -> ModelProfile:
        """A ModelProfile of this table: one layer per owning module.

        Args:
            name: the profile's name.
            module_order: owner modules in forward order (those missing from it follow, in
                registration order; None: registration order).
            forward_times, backward_times: seconds per owner module (missing: 0).
        """
        order = [m for m in (module_order or []) if m in self.owners]
        order += [m for m in self.owners if m not in order]
        forward_times = forward_times or {}
        backward_times = backward_times or {}
        layers = tuple(
            LayerProfile(
                module or "<root>",
                tuple(self.tensor_spec(p) for p in self.owners[module]),
                forward_times.get(module, 0.0),
                backward_times.get(module, 0.0),
            )
            for module in order
        )
        return ModelProfile(name, layers)

    def tensor_spec(self, name: str) -> TensorSpec:
        parameter = self.parameters[name]
        return TensorSpec(name, parameter.numel(), parameter.element_size(), tuple(parameter.shape))

    def tensor_specs(self) -> dict[str, TensorSpec]:
        """Every parameter's `tensor_spec`, by name (what a codec is set up for)."""
        return {name: self.tensor_spec(name) for name in self.parameters}

    def check_compressor(self, codec_name: str) -> None:
        """Compressors work on real gradients: a complex parameter would lose its imaginary part
        (the identity codec only copies and averages, which complex gradients take as they are)."""
        complex_names = [name for name, parameter in self.parameters.items() if parameter.is_complex()]
        if complex_names and codec_name != "identity":
            raise ConfigError(f"compressor {codec_name!r} works on real gradients; parameter(s) {complex_names[:5]} "
                              "are complex: train them without a compressor, or as real and imaginary parts")

    def check_optimizer(self, optimizer: torch.optim.Optimizer) -> None:
        """Every parameter the optimizer updates (or an OptimizerGroup's members) must belong to the
        model and be updated once (one frozen when the table was made and trainable now is the
        runtime's to judge: ``GradSync.check_optimizer``)."""
        held = Counter(id(p) for group in optimizer.param_groups for p in group["params"])
        twice = [name for name, p in self.parameters.items() if held[id(p)] > 1]
        if twice:
            raise ConfigError(f"parameters {twice[:5]} are each updated by two optimizers: give each parameter "
                              "to one optimizer")
        known = {id(p) for p in (*self.parameters.values(), *self.empty, *self.frozen.values())}
        foreign = [
            index
            for group in optimizer.param_groups
            for index, p in enumerate(group["params"])
            if p.requires_grad and id(p) not in known
        ]
        if foreign:
            raise ConfigError(
                f"optimizer holds {len(foreign)} parameter(s) that are not trainable parameters "
                "of the model; pass the optimizer built on this model's parameters"
            )

    def unfrozen(self) -> list[str]:
        """The `frozen` parameters that train now."""
        return [name for name, parameter in self.frozen.items() if parameter.requires_grad]

    def frozen_in(self, optimizer: torch.optim.Optimizer) -> dict[str, nn.Parameter]:
        """The `frozen` parameters `optimizer` holds, by name: one that trains later would be stepped
        with a gradient no rank averaged."""
        held = {id(p) for group in optimizer.param_groups for p in group["params"]}
        return {name: p for name, p in self.frozen.items() if id(p) in held}

    def check_profile(self, profile: ModelProfile) -> None:
        """A given profile must describe exactly these tensors."""
        mine = self.tensor_specs()
        theirs = profile.tensor_map()
        missing, extra = sorted(set(mine) - set(theirs)), sorted(set(theirs) - set(mine))
        if missing or extra:
            raise ConfigError(
                f"profile {profile.name!r} does not match the model: missing {missing[:5]}, unknown {extra[:5]}"
            )
        wrong = [n for n in mine if (mine[n].numel, mine[n].bytes_per_element)
                 != (theirs[n].numel, theirs[n].bytes_per_element)]
        if wrong:
            raise ConfigError(f"profile {profile.name!r}: sizes differ from the model for {wrong[:5]}")


def _borrow(borrowers: dict, module_name: str, module: nn.Module, owner: str) -> None:
    """Record that `module` holds a parameter `owner` owns (a tied weight)."""
    if owner == module_name:
        return
    owners = borrowers.setdefault(module_name, (module, []))[1]
    if owner not in owners:
        owners.append(owner)


def _check_dtypes(parameters: dict[str, nn.Parameter]) -> None:
    """Plans keep gradients of different element sizes apart, not dtypes of one size (fp16 and
    bf16): an op carrying both could not share one buffer."""
    examples: dict[int, dict[torch.dtype, str]] = {}  # element size -> dtype -> first parameter
    for name, parameter in parameters.items():
        examples.setdefault(parameter.element_size(), {}).setdefault(parameter.dtype, name)
    for size, by_dtype in examples.items():
        if len(by_dtype) > 1:
            named = ", ".join(f"{dtype} (e.g. {by_dtype[dtype]!r})" for dtype in sorted(by_dtype, key=str))
            raise ConfigError(f"trainable parameters mix dtypes of {size} bytes per element: {named}; "
                              "gradsync cannot keep their gradients apart: cast them to one dtype")
