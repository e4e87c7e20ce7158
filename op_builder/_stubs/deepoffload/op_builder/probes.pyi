# deepoffload.op_builder.probes is op_builder/probes.py installed under deepoffload (see __init__.pyi)
from op_builder.probes import *  # noqa: F403
