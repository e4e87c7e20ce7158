"""Integrations with other training stacks (each imported on demand; none is a dependency of deepoffload)."""
