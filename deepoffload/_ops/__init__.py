"""Prebuilt native ops, present when the package was built with DEEPOFFLOAD_BUILD_OPS=1 or DEEPOFFLOAD_BUILD_AIO=1.

``build_info.json`` beside them records what they were built against.
"""
