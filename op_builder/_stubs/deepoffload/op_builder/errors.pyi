# deepoffload.op_builder.errors is op_builder/errors.py installed under deepoffload (see __init__.pyi)
from op_builder.errors import *  # noqa: F403
