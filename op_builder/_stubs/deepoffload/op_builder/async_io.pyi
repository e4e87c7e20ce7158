# deepoffload.op_builder.async_io is op_builder/async_io.py installed under deepoffload (see __init__.pyi)
from op_builder.async_io import *  # noqa: F403
