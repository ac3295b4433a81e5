"""The engine: a Hugging Face model run through its own modules with kvbench's attention function.

Owns model loading (``models``), the attention function and the compression state (``attention``), the caches
(``kvcache``, ``quantcache``), a method's reconstruction forwards (``reconstruct``) and prefill/decode
(``generate``). Imports ``methods`` through its contract (``methods.base``) only; nothing of ``kvbench.job``,
``kvbench.report`` or ``kvbench.tools``.
"""
