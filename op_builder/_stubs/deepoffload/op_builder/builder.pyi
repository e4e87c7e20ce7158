# deepoffload.op_builder.builder is op_builder/builder.py installed under deepoffload (see __init__.pyi)
from op_builder.builder import *  # noqa: F403
