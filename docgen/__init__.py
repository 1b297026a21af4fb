"""The generators of the documentation pages made from data (``docs/selection.md``, ``docs/gpus.md``,
``docs/triton-configs.md``), kept out of the runtime package: ``python -m docgen.<page>`` rewrites a page,
``--check`` exits 1 when the committed page differs (the tests run the check).
"""
