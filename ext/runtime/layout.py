"""The live model's gradient layout: trainable parameters grouped by the module that owns them."""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from ..errors import ConfigError
from ..profile import LayerProfile, ModelProfile, TensorSpec


@dataclass(frozen=True)
class ParameterLayout:
    """Trainable parameters by qualified name (a shared parameter once, under its first name) and
    the modules that own them, in `module_order` (input → output once measured, else registration)."""

    parameters: dict[str, nn.Parameter]
    owners: dict[str, list[str]]  # module name -> names of the parameters it owns directly
    modules: dict[str, nn.Module]

    @classmethod
    def of(cls, model: nn.Module) -> "ParameterLayout":
        parameters: dict[str, nn.Parameter] = {}
        owners: dict[str, list[str]] = {}
        modules: dict[str, nn.Module] = {}
        seen: set[int] = set()
        for module_name, module in model.named_modules():
            for local_name, parameter in module.named_parameters(recurse=False):
                if not parameter.requires_grad or id(parameter) in seen:
                    continue
                seen.add(id(parameter))
                name = f"{module_name}.{local_name}" if module_name else local_name
                parameters[name] = parameter
                owners.setdefault(module_name, []).append(name)
                modules[module_name] = module
        if not parameters:
            raise ConfigError("model has no trainable parameters: nothing to synchronise")
        sparse = [name for name, module in modules.items()
                  if isinstance(module, (nn.Embedding, nn.EmbeddingBag)) and module.sparse]
        if sparse:
            raise ConfigError(f"modules {sparse} make sparse gradients (sparse=True), which gradsync cannot "
                              "all-reduce: construct them with sparse=False")
        return cls(parameters, owners, modules)

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
        """A ModelProfile of this layout: one layer per owning module, in `module_order`
        (modules missing from it keep registration order after the ordered ones)."""
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

    def check_optimizer(self, optimizer: torch.optim.Optimizer) -> None:
        """Every parameter the optimizer updates must belong to the model."""
        known = {id(p) for p in self.parameters.values()}
        frozen_or_foreign = [
            index
            for group in optimizer.param_groups
            for index, p in enumerate(group["params"])
            if p.requires_grad and id(p) not in known
        ]
        if frozen_or_foreign:
            raise ConfigError(
                f"optimizer holds {len(frozen_or_foreign)} parameter(s) that are not trainable parameters "
                "of the model; pass the optimizer built on this model's parameters"
            )

    def check_profile(self, profile: ModelProfile) -> None:
        """A given profile must describe exactly these tensors."""
        mine = {name: self.tensor_spec(name) for name in self.parameters}
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
