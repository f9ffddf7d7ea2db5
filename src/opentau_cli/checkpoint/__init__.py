"""Checkpoints: manifest (size + hash of every file), atomic save / resume (manager), streaming consolidation,
inspect / verify / list."""
