"""Lightning strategies that run training with gradsync's runtime (registered on import)."""
