"""What one engine step is: its metadata (``metadata``: ``BatchMetadata``), the paged latent cache it writes
(``cache``: ``LatentKVCache``), the persistent metadata of CUDA-graph decode (``graph``: ``DecodeGraphMetadata``),
the refusals for metadata an entry would misread (``checks``) and the frozen per-step plan (``plan``:
``plan_step``, ``StepPlan``), the one owner of everything a step works out once.

Imports: ``mla_backends.core`` and each other; nothing above (backends and layers take part in a plan through
the duck-typed ``plan_request`` protocol, so this layer never imports them).
"""
