"""The one exception type for user mistakes on the login-node side.

The CLI turns a ``UserError`` into one stderr line and exit code 2; anything
else is a bug and may show a traceback.
"""

from __future__ import annotations


class UserError(Exception):
    """Bad input from the user: names the field, the value and what is allowed."""

    exit_code = 2
