"""The recipes' Hydra configs (pkg://gradsync.recipes.conf): one config group per subpackage."""
