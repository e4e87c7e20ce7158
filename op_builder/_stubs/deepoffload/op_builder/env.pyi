# deepoffload.op_builder.env is op_builder/env.py installed under deepoffload (see __init__.pyi)
from op_builder.env import *  # noqa: F403
