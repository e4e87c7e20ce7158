"""Setting blocks up from a checkpoint or an initializer.

A model on the ``meta`` device is made block by block straight to storage.
"""
