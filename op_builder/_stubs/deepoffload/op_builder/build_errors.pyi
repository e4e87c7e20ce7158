# deepoffload.op_builder.build_errors is op_builder/build_errors.py installed under deepoffload (see __init__.pyi)
from op_builder.build_errors import *  # noqa: F403
