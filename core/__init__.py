"""core: the bottom layer (model blocks, assets, conventions, drafter definitions); imports nothing else of ours."""

__version__ = "0.1.0"  # the spectrain distribution's version (recorded in dataset manifests)
