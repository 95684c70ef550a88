"""The one exception type for user mistakes on the compute-node side."""

from __future__ import annotations


class ConfigError(Exception):
    """Bad configuration or launcher environment: names the field, the value, what is allowed.

    ``python -m ddp`` and ``python -m ddp.exec`` turn it into one stderr line and
    exit code 2.
    """

    exit_code = 2


class TrainingDiverged(ConfigError):
    """The loss or the weights became NaN/inf: the run stops, nothing is saved from them.

    A user's matter to fix (learning rate, clipping, precision), so one line and exit 2.
    """
