# deepoffload.op_builder.versions is op_builder/versions.py installed under deepoffload (see __init__.pyi)
from op_builder.versions import *  # noqa: F403
