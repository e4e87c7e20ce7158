"""The blocks of a streamed model.

How they are found, what each is (``Block``, its residency), what its parameters hold while on storage, the order they
are read in, and what is attached to the modules that hold them.
"""
