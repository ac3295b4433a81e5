"""kvbench's Hydra plugins: the local sweep launcher and the config schemas (:func:`kvbench.job.config.register`)."""

from kvbench.job.config import register

register()
