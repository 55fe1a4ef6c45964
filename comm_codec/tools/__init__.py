"""Programs: the ``comm-codec`` command line, benchmarks, demos, the in-repo TinyLM, pretrained loaders.

Nothing else in the package imports this layer.
"""
