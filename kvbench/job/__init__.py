"""One job: model x method x task x budget, from composed config to stored records.

Owns the checked configuration and the job's identity (``config``), a sample's token ids (``prompts``), the
steps of a job and a sweep (``run``), the units of samples and answers (``runner``), the results store
(``store``), the NIAH heatmap it draws and reports reuse (``plots``) and rescoring of stored files
(``score``). Imports ``kvbench.engine``, ``methods`` and ``eval``; never ``kvbench.report`` or ``kvbench.tools``.
"""
