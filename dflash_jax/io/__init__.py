"""Files in and out: safetensors checkpoints (read lazily, with a manifest), atomic writes of user files, JAX's
persistent compilation cache for the commands that compile (``compile_cache``).

The layer under the models: nothing here knows a model's structure; ``models/`` maps checkpoint keys
onto module paths and calls these readers and writers.
"""
