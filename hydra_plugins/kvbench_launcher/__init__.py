"""kvbench's Hydra plugins: the local sweep launcher (``local_launcher``) and the config schemas, stored in Hydra's
ConfigStore when Hydra scans its plugins, before it composes a config (:func:`kvbench.job.config.register`)."""

from kvbench.job.config import register

register()
