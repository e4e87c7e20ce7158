"""The demo's built-in model and data (``model``) and its training comparison (``train``)."""
