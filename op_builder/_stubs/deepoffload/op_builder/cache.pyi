# deepoffload.op_builder.cache is op_builder/cache.py installed under deepoffload (see __init__.pyi)
from op_builder.cache import *  # noqa: F403
