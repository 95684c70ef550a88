"""What both sides of the wall share: concepts the login side (``hpc``) and the compute side
(``ddp``) must agree on, written once.

Why a package of its own: ``hpc`` never imports ``ddp`` (it runs on login nodes where
importing the compute side would drag its modules in and tie the two together) and ``ddp``
never imports ``hpc``. A concept both need (the strict YAML rules, the rendezvous port
rule, torchrun's variable set, atomic writes, run-directory locks, the run directory's
file names) lived twice and drifted. Here it lives once, and an import-linter contract keeps this package below both
sides: it imports neither ``hpc``, ``ddp`` nor ``torch`` -- only the standard library, and
PyYAML (both sides' dependency) on first use in :mod:`hpc_ddp.strict_yaml`.

Errors are the standard library's (``OSError``) or this package's plain ``ValueError``
subclasses carrying one line: each side words them as its own error type
(``hpc.errors.UserError``, ``ddp.errors.ConfigError``) with its own label in front.
"""
