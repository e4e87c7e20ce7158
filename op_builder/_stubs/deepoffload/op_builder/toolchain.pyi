# deepoffload.op_builder.toolchain is op_builder/toolchain.py installed under deepoffload (see __init__.pyi)
from op_builder.toolchain import *  # noqa: F403
