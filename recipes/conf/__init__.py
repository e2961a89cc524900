"""The recipes' Hydra configs (pkg://gradsync.recipes.conf): one config group per subpackage, and
the structured configs that loading this package registers (the schema and the strategy group)."""
from .. import schema  # noqa: F401  (registers them in Hydra's ConfigStore)
