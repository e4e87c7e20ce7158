"""The checkpoint formats deepoffload ships, one file each (registered by ``deepoffload.formats.registry``)."""
