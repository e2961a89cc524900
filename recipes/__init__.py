"""Hydra recipes (package data) and the `gradsync-train` application."""
