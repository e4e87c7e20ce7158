# deepoffload.op_builder.hints is op_builder/hints.py installed under deepoffload (see __init__.pyi)
from op_builder.hints import *  # noqa: F403
