"""What a streamed model refuses, each with a message saying what works.

Arguments and sharing, a backward that cannot train a block, parameters replaced after offloading, and wrappers (DDP,
FSDP) around a streamed model.
"""
