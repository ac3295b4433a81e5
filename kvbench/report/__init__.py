"""Reports: every job folder under a results root read into one tidy frame (``data``), then tables and figures, each
a function of that frame (``tables``, ``cost``, ``reasoning``, ``scbench``); ``build`` writes them (``kvbench
report``). Imports ``kvbench.job`` (the store, presets) and ``eval``; never ``kvbench.engine`` or ``kvbench.tools``."""
