"""Hydra config group: package data found through pkg://gradsync.recipes.conf."""
